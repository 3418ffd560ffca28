"""Faithful replay of one top-level call, after a hit, with every watched module instrumented.

The replay uses the call's own inputs (references kept for the step), the parameters as they are
before the optimizer applies the step, the RNG state captured at the call (CPU and CUDA), its
autocast and grad mode. Buffers (BatchNorm statistics) and the user's RNG stream are restored
afterwards, and no `.grad` is touched: the user's run goes on exactly as if no replay happened.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import random
import sys
import threading
import types
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import is_, is_not
from threading import get_ident
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .._hooks import REPLAYING, ReplayHooks, replaying
from .._steplog import Top, given
from .._tensors import (
    Path,
    is_bad,
    own_tensors,
    poison,
    probe,
    real_view,
    same,
    stack_probes,
    strided,
    tensors,
    values,
    version,
)

__all__ = ["ReplayCall", "Replay", "replay_top", "faithful", "as_it_is", "CollectiveRefused"]

_logger = logging.getLogger("nanhunt")


class CollectiveRefused(RuntimeError):
    """A collective in a replay, which runs on one rank alone (`nanhunt._locate._NoCollectives`)."""

    def __init__(self, op: str) -> None:
        super().__init__(f"nanhunt: {op} in a replay on one rank: the other ranks would never join it")
        self.op = op


@dataclass
class ReplayCall:
    """One watched call seen by a replay. Finiteness is read lazily: only the calls the analysis
    looks at pay the host reads."""

    module: nn.Module
    name: str
    ordinal: int
    depth: int
    parent: int
    inputs: list[tuple[Path, torch.Tensor]] = field(default_factory=list)
    outputs: list[tuple[Path, torch.Tensor]] = field(default_factory=list)
    wrapped: dict[Path, torch.Tensor] = field(default_factory=dict)  # sparse or nested outputs as returned (for `element`'s index)
    wrapped_in: dict[Path, torch.Tensor] = field(default_factory=dict)  # sparse or nested inputs as given (the same)
    in_keys: list[tuple[int, Path]] = field(default_factory=list)
    out_keys: list[tuple[int, Path]] = field(default_factory=list)
    done: int = -1  # completion order
    at_return: list[torch.Tensor | None] = field(default_factory=list)  # per output: "all finite?" when the call returned
    versions: list[int] = field(default_factory=list)  # per output: its version when the call returned
    in_versions: dict[Path, int] = field(default_factory=dict)  # per positional input: its version when the call began
    _out_bad: list[bool] | None = None
    _in_bad: list[bool] | None = None
    _in_nan: list[bool] | None = None
    _params_bad: list[str] | None = None
    given: bool = False  # ran on tensors given to torch.func.functional_call in place of its parameters
    before: dict[int, torch.Tensor | None] = field(default_factory=dict)  # buffers: their value before the call

    @property
    def out_bad(self) -> list[bool]:
        """Per output: non-finite when the call returned (the caller may write it in place after)."""
        if self._out_bad is None:
            if len(self.at_return) == len(self.outputs):
                self._out_bad = [f is not None and not bool(f) for f in self.at_return]
            else:
                self._out_bad = bad_flags([t for _, t in self.outputs])
        return self._out_bad

    def written(self) -> bool:
        """Was an output written in place after the call returned?"""
        return any(version(t) != v for (_, t), v in zip(self.outputs, self.versions))

    def wrote_inputs(self) -> bool:
        """Did the call write one of its inputs in place (``x.div_(...)`` returned as its output)?
        Then the input read now is not what came in."""
        at = self.in_versions
        return any(p in at and version(t) != at[p] for p, t in self.inputs)

    @property
    def in_bad(self) -> list[bool]:
        if self._in_bad is None:
            self._in_bad = bad_flags([t for _, t in self.inputs])
        return self._in_bad

    @property
    def in_nan(self) -> list[bool]:
        if self._in_nan is None:
            self._in_nan = [b and bool(torch.isnan(t).any()) for b, (_, t) in zip(self.in_bad, self.inputs)]
        return self._in_nan

    @property
    def in_fed(self) -> list[bool]:
        """Inputs that feed a NaN on: NaN, or +inf (a -inf alone is a mask's value by design,
        which a softmax of a fully masked row turns into the NaN born there)."""
        return [n or (b and bool((t == float("inf")).any())) for n, b, (_, t) in zip(self.in_nan, self.in_bad, self.inputs)]

    @property
    def params_bad(self) -> list[str]:
        if self._params_bad is None:
            # judged on the state at the start of the call: a buffer counts by its value before it
            # (a BatchNorm's statistics written non-finite by this very call are not the cause)
            before = self.before
            self._params_bad = [n for n, p in own_tensors(self.module)
                                if (is_bad(before[id(p)]) if id(p) in before else is_bad(p))]
        return self._params_bad


@dataclass
class Replay:
    calls: list[ReplayCall]
    order: list[int]  # call indices in completion (post-hook) order
    output: Any
    grads: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (tensor key, grad) in autograd order
    param_grads: list[tuple[nn.Parameter, torch.Tensor | None]] = field(default_factory=list)
    error: str | None = None
    collective: str | None = None  # the collective the replay stopped at (`CollectiveRefused`), if it did
    drew: str | None = None  # the Python random stream the forward drew from ("Python's random", "NumPy's random"), if any
    # calls whose outputs (or inputs) were written in place after they returned (after they began),
    # of which no copy was kept: their values now are not those of the call (`replay_top`'s focus)
    unkept: frozenset[int] = frozenset()

    def needs_exact(self, focus: Callable[[Replay], list[ReplayCall | None]] | None) -> bool:
        """Does a reader of ``focus``'s calls need a call's values this replay did not keep?"""
        return bool(self.unkept) and bool(self.unkept & _needed(self, focus))

    def read_outputs(self) -> None:
        """Every call's output flags in one batch: one host read for the whole replay."""
        todo = [c for c in self.calls if c._out_bad is None]
        flags = [f for c in todo for f in c.at_return if f is not None]
        flat = iter((~stack_probes(flags)).tolist() if flags else [])  # one read (model parallel: on one device)
        for c in todo:
            if len(c.at_return) == len(c.outputs):
                c._out_bad = [f is not None and next(flat) for f in c.at_return]


def bad_flags(ts: list[torch.Tensor]) -> list[bool]:
    """Which tensors hold a non-finite value: probe sums in one read, exact checks on suspects."""
    idx = [i for i, t in enumerate(ts) if (t.is_floating_point() or t.is_complex()) and t.numel()]
    out = [False] * len(ts)
    if not idx:
        return out
    with torch.no_grad():
        sums = stack_probes([probe(ts[i]) for i in idx])
        suspects = (~torch.isfinite(sums)).tolist()
    for i, s in zip(idx, suspects):
        out[i] = s and is_bad(ts[i])  # a finite tensor whose sum overflowed is not bad
    return out


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A device-side 0-dim bool: is every element of ``t`` finite? Exact (`_tensors.poison`: NaN
    iff one is not), in two passes and one temporary where ``isfinite(t).all()`` makes five and
    three (a replay checks every call's outputs: on a CNN's large activations that was a sixth
    of a hit's analysis). Complex as its real view: torch has no sum of complex32."""
    p = poison(real_view(t))
    return p == p


@contextlib.contextmanager
def faithful(top: Top, *, compiled: bool = False) -> Iterator[list[torch.Tensor]]:
    """Run inside the state ``top`` was called in; restore the user's state afterwards.

    A ``model.compile()``d module, or a compiled submodule, runs eagerly here (``force_eager``: a
    replay records every watched call), unless ``compiled``: the caller runs the failing configuration itself.
    Yields the leaves its inputs were cut from the graph at (see `_cut`): a backward of the replay takes
    them as inputs too, to see the gradients of the call's inputs."""
    mod = top.module
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if top.cuda_rng is not None else None
    with torch.no_grad():
        bufs = [(b, b.clone()) for b in mod.buffers() if not b.is_meta]  # (a meta placeholder: no values)
        for b, _ in bufs:  # start from the buffers as they were before the call (BatchNorm statistics)
            v = top.saved.get(id(b))
            if v is not None:
                b.data.copy_(v)  # .data: no version bump (see the restore below)
    # the model switched to eval (or back) since the call (a validation pass before the step
    # ended): the replay runs in the call's mode, every module's flag put back afterwards
    modes = [(m, m.training) for m in mod.modules()] if mod.training != top.training else []
    kept = _Attributes(mod)
    stack = contextlib.ExitStack()
    given_in = (top.args, top.kwargs)
    try:
        # a Cache the user passed in (generation), a list the call appends to: the replay runs on
        # copies (5 replays appended 5 keys to the user's KV cache, which the run then generated from)
        top.args, top.kwargs = given_objects(given_in)
        cut: list[torch.Tensor] = []
        top.args, top.kwargs = tree_map(lambda v: _cut(v, cut) if isinstance(v, torch.Tensor) else v,
                                        (top.args, top.kwargs))
        for m, _ in modes:
            m.training = top.training
        if modes:
            for m in top.odd_modes:  # a frozen BatchNorm stays in eval while the model trained
                m.training = not top.training
        stack.enter_context(replaying())  # no hunt's hooks see a replay (see _hooks)
        if not compiled and "torch._dynamo" in sys.modules and _holds_compiled(mod):  # model.compile(), a compiled submodule
            stack.enter_context(torch.compiler.set_stance("force_eager"))  # (not a compiled function it calls: flex_attention)
        torch.set_rng_state(top.rng)
        if top.cuda_rng is not None:
            torch.cuda.set_rng_state_all(top.cuda_rng)
        for dev, enabled, dtype in top.autocast:
            if enabled:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
        if top.reparam:  # called through torch.func.functional_call: with the tensors it was given
            from torch.nn.utils.stateless import _reparametrize_module

            tensors_given, tie = given(top)
            stack.enter_context(_reparametrize_module(mod, tensors_given, tie_weights=tie))
        stack.enter_context(torch.set_grad_enabled(top.grad_enabled))
        if not compiled:
            stack.enter_context(_checkpoint_inline())
        yield cut
    finally:
        stack.close()
        try:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            with torch.no_grad():
                for b, v in bufs:
                    # only what the replay changed, through .data: a version bump would break a graph
                    # that saved the buffer (BERT's token_type_ids in its embedding's backward, which a
                    # backward replay runs after this context; the user's own pending graph)
                    if not same(b, v):
                        b.data.copy_(v)
        finally:
            top.args, top.kwargs = given_in
            kept.restore()  # the modules' own Python state (their training flags too)


def _cut(t: torch.Tensor, leaves: list[torch.Tensor]) -> torch.Tensor:
    """An input made by a graph before the call (a hidden state another top-level call returned: a
    decoder called once per time step) as a copy whose graph ends at a leaf of its own, added to
    ``leaves``: a backward of the replay stops there instead of running into the step's graph,
    which the step's backward has already run and freed (every gradient replay failed)."""
    if not t.requires_grad or t.is_leaf:
        return t
    with torch.no_grad():
        leaf = t.detach().requires_grad_()
    leaves.append(leaf)
    return leaf.clone()  # (not the leaf itself: a forward may write its input in place)


def as_it_is(x: Any) -> Any:
    """A tree with every tensor copied as it is now (its requires_grad kept): a replay that runs
    the forward to its end reads a call's inputs and outputs as they were at the call, though the
    caller's code may write them in place afterwards."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch.no_grad():
        c = x.detach().clone()
    return c.requires_grad_(x.requires_grad) if c.is_floating_point() or c.is_complex() else c


_ATOMS = frozenset((type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout))
_MAX_WALK = 1 << 14  # objects walked for the tensors an input holds; past that it is kept as it is


def given_objects(x: Any) -> Any:
    """A call's inputs for a replay: the tensors themselves (a replay maps them to the log), every
    other object (a transformers ``Cache`` the user passed in, a list the call appends to) a copy
    holding the same tensors, so that a replay never changes what the user holds (a cache's
    appends make new tensors; a static cache's in-place writes put back what the call wrote)."""
    return tree_map(lambda v: v if isinstance(v, torch.Tensor) else copy_object(v, share=True), x)


def fresh(x: Any) -> Any:
    """A call's inputs for one run of it: tensors copied as they are now, and any other object (a
    transformers ``Cache``, empty until the call fills it) deep-copied, its tensors detached. A call
    changes what it is given (a Cache it appends its keys to, an input written in place): each run
    needs its own copy, and the user's objects stay untouched. Modules and functions are shared; an
    object that cannot be copied (or refers to too many to walk) is kept as it is."""
    return tree_map(lambda v: as_it_is(v) if isinstance(v, torch.Tensor) else copy_object(v), x)


def copy_object(obj: Any, share: bool = False) -> Any:
    """``obj`` deep-copied with the tensors it holds copied as they are (``share``: the same
    tensors; see `fresh`); ``obj`` itself when it is a value, a module, a function, or cannot be copied."""
    if type(obj) in _ATOMS or isinstance(obj, (nn.Module, type)) or callable(obj):
        return obj  # (a module, a function, a bound method: shared, never copied)
    held: dict[int, Any] = {}  # the tensors and modules it refers to
    seen: set[int] = set()
    todo = [obj]
    try:
        while todo:
            v = todo.pop()
            if isinstance(v, (torch.Tensor, nn.Module)):
                held[id(v)] = v
                continue
            if type(v) in _ATOMS or id(v) in seen:
                continue
            seen.add(id(v))
            if len(seen) > _MAX_WALK:
                return obj
            if isinstance(v, dict):
                todo.extend(v.values())
            elif isinstance(v, (list, tuple, set, frozenset, deque)):
                todo.extend(v)
            elif isinstance(v, types.MethodType):
                todo.append(v.__self__)  # (deepcopy copies a bound method's object)
            else:
                todo.extend(getattr(v, "__dict__", {}).values())
        # its tensors copied as they are (deepcopy refuses one with a history); a module stays shared
        memo = {k: v if share or isinstance(v, nn.Module) else as_it_is(v) for k, v in held.items()}
        return copy.deepcopy(obj, memo)
    except Exception as exc:
        _logger.debug("nanhunt: a copy of a %s input failed, kept as it is (%s: %s)", type(obj).__name__,
                      type(exc).__name__, exc)
        return obj


def _holds_compiled(mod: nn.Module) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule"
               for m in mod.modules())


_MAX_ATTR = 1 << 20  # a plain tensor attribute's values are kept up to this many elements
_MAX_ITEMS = 1 << 16  # a container attribute's items are kept up to this many
_CONTAINERS = (list, dict, set, collections.deque)


def _items(c: Any) -> list[Any]:
    """A container's items as they are now, each compared by identity (a dict's keys and values
    in turn; a set's in its order)."""
    return [x for kv in c.items() for x in kv] if type(c) is dict else list(c)


def _refill(c: Any, items: list[Any]) -> None:
    """Put `_items` back into ``c``, the same object."""
    c.clear()
    if type(c) is dict:
        c.update(zip(items[::2], items[1::2]))
    elif type(c) is set:
        c.update(items)
    else:  # a list, a deque
        c.extend(items)


class _Attributes:
    """The modules' own Python state, which a replay of their forward may change: attributes
    (a call counter, a warm-up gate, a cache built on first use), buffers replaced by
    assignment, plain tensor attributes written in place (a running average that is not a
    buffer), and the items of plain lists, dicts, sets and deques held as attributes (a list
    of what the module saw, a KV cache appended to). `restore` puts back what changed, values
    through ``.data`` (no version bump), containers' items in the same objects."""

    def __init__(self, root: nn.Module) -> None:
        # (not a TorchScript module's: its state lives in the interpreter, behind dicts of its own)
        self.dicts = [(m, dict(m.__dict__), dict(m._buffers), dict(m._parameters)) for m in root.modules()
                      if not isinstance(m, torch.jit.ScriptModule)]
        with torch.no_grad():  # (values only: a meta or sparse attribute keeps its reference alone)
            self.values = [(t, t.clone()) for _, d, _, _ in self.dicts for k, t in d.items()
                           if type(t) is torch.Tensor and not k.startswith("_") and not t.is_meta
                           and t.layout is torch.strided and t.numel() <= _MAX_ATTR]
        # a generator of the module's own (torch.randn(..., generator=self.gen)): its stream too
        self.gens = [(g, g.get_state()) for _, d, _, _ in self.dicts for g in d.values() if type(g) is torch.Generator]
        self.items = [(c, _items(c)) for _, d, _, _ in self.dicts for k, c in d.items()
                      if type(c) in _CONTAINERS and not k.startswith("_") and len(c) <= _MAX_ITEMS]

    def restore(self) -> None:
        for m, d, b, p in self.dicts:
            pairs: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
                (m.__dict__, d), (m._buffers, b), (m._parameters, p))
            for now, was in pairs:
                if now.keys() == was.keys() and all(map(is_, now.values(), was.values())):
                    continue  # (as it was: most modules; C-level passes)
                for k in [k for k in now if k not in was]:  # added by the replay
                    del now[k]
                for k, v in was.items():
                    if now.get(k, _NONE) is not v:
                        if getattr(type(v), "__nanhunt__", False) and getattr(v, "hunt", None) is None:
                            continue  # a hunt's `forward` wrapper its close() took off meanwhile (another thread)
                        now[k] = v
        for g, state in self.gens:
            g.set_state(state)
        for c, items in self.items:
            cur = _items(c)
            if len(cur) != len(items) or any(map(is_not, cur, items)):
                _refill(c, items)
        with torch.no_grad():
            for t, v in self.values:
                try:
                    if not same(t, v):
                        t.data.copy_(v)
                except RuntimeError:  # (resized or moved by the replay: its reference went back above)
                    pass


@contextlib.contextmanager
def _checkpoint_inline() -> Iterator[None]:
    """A ``checkpoint(fn, *args, use_reentrant=True)`` block runs as ``fn(*args)`` in a replay.

    The reentrant checkpoint runs its block under no_grad and again inside the backward, in a
    nested backward of its own: a replay's hooks would see no gradient inside the block, and a
    NaN born there would surface at the block's boundary (the wrong module). Run directly, the
    block computes the same values (a replay starts from the call's RNG state, as the checkpoint
    does) and its backward passes through its modules. The non-reentrant checkpoint needs no
    help: its backward already does. The class attribute is process-wide: it is put on once for
    all replays running at a time (threads: two hunts' analyses, or `nanhunt.replay`, at once),
    acts only on a thread that is replaying, and is put back when the last one ends."""
    global _ck_depth, _ck_had
    ck = sys.modules.get("torch.utils.checkpoint")
    cls = getattr(ck, "CheckpointFunction", None)
    if cls is None:
        yield
        return
    with _CK_LOCK:
        if _ck_depth == 0:
            _ck_had = cls.__dict__.get("apply", _NONE)
            orig = cls.apply  # (bound: the class's own or torch.autograd.Function's)

            def inline(_cls: Any, run_function: Any, preserve_rng_state: Any, *args: Any) -> Any:
                if REPLAYING and get_ident() in REPLAYING:
                    return run_function(*args)
                return orig(run_function, preserve_rng_state, *args)

            cls.apply = classmethod(inline)
        _ck_depth += 1
    try:
        yield
    finally:
        with _CK_LOCK:
            _ck_depth -= 1
            if _ck_depth == 0:
                if _ck_had is _NONE:
                    del cls.apply
                else:
                    cls.apply = _ck_had
                _ck_had = None


_CK_LOCK = threading.Lock()
_ck_depth = 0
_ck_had: Any = None
_NONE = object()


def replay_top(
    top: Top,
    names: dict[nn.Module, str],
    *,
    backward: list[torch.Tensor | None] | None = None,
    params: list[nn.Parameter] | None = None,
    before: dict[int, torch.Tensor | None] | None = None,
    focus: Callable[[Replay], list[ReplayCall | None]] | None = None,
) -> Replay:
    """Re-run ``top`` with every watched module call recorded.

    With ``backward`` (the gradients that arrived at the top-level outputs, in output order), also
    run the backward pass through ``torch.autograd.grad`` (nothing accumulates into ``.grad``),
    recording the gradient of every module input and output in the order autograd produced them.

    Each output is judged as it was when its call returned. When a non-finite output was written
    in place afterwards (a clamp_ or ReLU(inplace) in the caller's code), the call is replayed once
    more keeping a copy of those outputs, so that its element and value are the ones it made.
    Only when the reader needs one of them: ``focus`` gives the calls it will read (the log's
    first non-finite call, the first one the analysis does not ignore); the values of every call
    that ended no later than those, or than the replay's first non-finite call, and of the calls
    around them, are the ones they made (`_needed`). A call after them written in place (the
    ReLU(inplace) after each BatchNorm downstream of the NaN) costs no second forward; its
    ordinal is in `Replay.unkept`. Without ``focus``, every call's.
    """
    r = _replay_top(top, names, backward, params, before, frozenset())
    if r.error is None:
        stale = frozenset(c.ordinal for c in r.calls if c.written() and any(c.out_bad))
        # an input the call itself wrote in place (and made non-finite): a copy of it as it came in
        wrote_in = frozenset(c.ordinal for c in r.calls if c.wrote_inputs() and any(c.in_bad))
        if (stale or wrote_in) and (focus is None or (stale | wrote_in) & _needed(r, focus)):
            again = _replay_top(top, names, backward, params, before, stale, wrote_in)
            if again.error is None and [c.module for c in again.calls] == [c.module for c in r.calls]:
                return again
        else:
            r.unkept = stale | wrote_in
    return r


def _needed(r: Replay, focus: Callable[[Replay], list[ReplayCall | None]] | None) -> frozenset[int]:
    """The calls whose values a reader of ``focus``'s calls reads: every call that ended no later
    than the last of them or than the replay's first call with a non-finite output, and every call
    around those (an enclosing module's own code may be where it was born). Without ``focus``: all."""
    if focus is None:
        return frozenset(range(len(r.calls)))
    r.read_outputs()
    first = next((r.calls[o] for o in r.order if any(r.calls[o].out_bad)), None)
    marks = [c for c in (*focus(r), first) if c is not None]
    if not marks:
        return frozenset()
    bound = max(c.done for c in marks)
    need = {c.ordinal for c in r.calls if 0 <= c.done <= bound or c.done < 0}
    for c in marks:
        p = c.parent
        while p >= 0:
            need.add(p)
            p = r.calls[p].parent
    return frozenset(need)


def _replay_top(
    top: Top,
    names: dict[nn.Module, str],
    backward: list[torch.Tensor | None] | None,
    params: list[nn.Parameter] | None,
    before: dict[int, torch.Tensor | None] | None,
    keep: frozenset[int],
    keep_given: frozenset[int] = frozenset(),
) -> Replay:
    calls: list[ReplayCall] = []
    came_in: dict[int, dict[Path, torch.Tensor]] = {}  # per call in keep_given: its inputs as they came in
    hooked: dict[int, list[tuple[Path, torch.Tensor]]] = {}  # per call of a module with pre-hooks of its own: its args before them
    order: list[int] = []
    stack: list[int] = []
    keys: dict[int, int] = {}
    key_tensors: list[torch.Tensor] = []
    grads: list[tuple[int, torch.Tensor]] = []
    handles: list[Any] = []
    want_grad = backward is not None

    def key(t: torch.Tensor) -> int:
        k = keys.get(id(t) * 1_000_003 + t._version)
        if k is not None and key_tensors[k] is t:
            return k
        k = len(key_tensors)
        key_tensors.append(t)
        keys[id(t) * 1_000_003 + t._version] = k
        handles.append(t.register_hook(lambda g, k=k: grads.append((k, g)) if g is not None else None))
        return k

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        name = names.get(module)
        if name is None:
            return
        parent = stack[-1] if stack else -1
        c = ReplayCall(module, name, len(calls), len(stack), parent)
        if before:
            c.before = before
        if top.reparam or any(type(t) is not nn.Parameter for t in module._parameters.values() if t is not None):
            # judged now: functional_call's tensors are the module's only during the call (also a
            # child's, run on adapted weights inside the forward: a meta-learning inner step)
            c.given = bool(c.params_bad)
        ins = list(tensors((args, {})))
        c.in_versions = {p: version(t) for p, t in ins}
        if module._forward_pre_hooks:  # (a user's: they run after this global hook and may replace the args)
            hooked[c.ordinal] = ins
        if c.ordinal in keep_given:  # it writes an input in place (see replay_top): keep it as it comes in
            with torch.no_grad():
                came_in[c.ordinal] = {p: strided(t).detach().clone() for p, t in ins}
        calls.append(c)
        stack.append(c.ordinal)

    def post(module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any = None) -> None:
        if not stack or calls[stack[-1]].module is not module:
            return
        c = calls[stack.pop()]
        c.done = len(order)
        order.append(c.ordinal)
        # a sparse or nested tensor is judged by its values (flat: an element is its place among them)
        ins = list(tensors((args, kwargs if isinstance(kwargs, dict) else {})))
        c.inputs = [(p, strided(t)) for p, t in ins]
        c.wrapped_in = {p: t for p, t in ins if t.is_nested or t.layout is not torch.strided}
        outs = list(tensors(output))
        c.outputs = [(p, strided(t)) for p, t in outs]
        c.wrapped = {p: t for p, t in outs if t.is_nested or t.layout is not torch.strided}
        with torch.no_grad():
            c.at_return = [_all_finite(values(t)) if (t.is_floating_point() or t.is_complex()) and t.numel()
                           else None for _, t in c.outputs]
        c.versions = [version(t) for _, t in c.outputs]
        if want_grad and torch.is_grad_enabled():
            for p, t in c.outputs:
                if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                    c.out_keys.append((key(t), p))
            for p, t in c.inputs:
                if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                    c.in_keys.append((key(t), p))
        if c.ordinal in keep:  # written after it returns (see replay_top): keep it as it is now
            c.outputs = [(p, t.detach().clone()) for p, t in c.outputs]
            c.wrapped = {p: t.detach().clone() for p, t in c.wrapped.items()}
            c.versions = [version(t) for _, t in c.outputs]
        copies = came_in.get(c.ordinal)
        if copies:  # (after its gradient keys: those are the tensors the graph holds)
            c.inputs = [(p, copies.get(p, t)) for p, t in c.inputs]
            c.in_versions = {}
        elif c.ordinal in hooked:  # judged as they came in: a NaN its own pre-hook made (x / x.std() of a
            # constant input) was born in this call, not fed to it (the kwargs as the pre-hooks left them)
            c.inputs = [(p, strided(t)) for p, t in hooked.pop(c.ordinal)] + [(p, t) for p, t in c.inputs if p[0] == 1]

    hooks = ReplayHooks(pre, post)
    result = Replay(calls, order, None)
    try:
        streams = _streams()
        with faithful(top) as cut:
            if want_grad:
                with torch.enable_grad():
                    out = top.module(*top.args, **(top.kwargs or {}))
            else:
                out = top.module(*top.args, **(top.kwargs or {}))
        result.output = out
        result.drew = _drew(streams)
        hooks.remove()
        if want_grad:
            outs = [t for _, t in tensors(out) if t.requires_grad]
            pairs = _roots([(o, g) for o, g in zip(outs, backward or []) if g is not None])
            leaves: list[torch.Tensor] = [p for p in (params or []) if p.requires_grad]
            leaves += [t for _, t in tensors(top.args) if t.requires_grad and t.is_leaf] + cut
            if pairs and leaves:
                gs = torch.autograd.grad(
                    [o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True
                )
                result.param_grads = [(p, g) for p, g in zip(leaves, gs) if isinstance(p, nn.Parameter)]
            result.grads = grads
    except Exception as e:  # a replay must never break the user's run
        result.error = f"{type(e).__name__}: {e}"
        if isinstance(e, CollectiveRefused):
            result.collective = e.op
    finally:
        hooks.remove()
        for h in handles:
            h.remove()
    return result


def _streams() -> tuple[Any, Any]:
    """The states of Python's and NumPy's random streams, which a replay cannot put back as they
    were at the call (recording them costs each step ~16 and ~65 us): only whether it drew from them."""
    np = sys.modules.get("numpy")
    npst = np.random.get_state() if np is not None else None
    return random.getstate(), (npst[1].tobytes(), npst[2]) if npst is not None else None


def _drew(before: tuple[Any, Any]) -> str | None:
    """Which of those streams the forward drew from since `_streams` gave ``before``."""
    now = _streams()
    return "Python's random" if now[0] != before[0] else "NumPy's random" if now[1] != before[1] else None


def _roots(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Drop outputs computed from other outputs inside the model (logits under an in-model loss):
    their captured gradient already includes what flowed from the other output."""
    if len(pairs) < 2:
        return pairs
    reach: list[set[Any]] = []
    for o, _ in pairs:
        seen: set[Any] = set()
        todo = [fn for fn, _ in (o.grad_fn.next_functions if o.grad_fn is not None else ())]
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            todo.extend(n for n, _ in fn.next_functions)
        reach.append(seen)
    return [
        (o, g) for i, (o, g) in enumerate(pairs)
        if not any(o.grad_fn is not None and o.grad_fn in reach[j] for j in range(len(pairs)) if j != i)
    ]

