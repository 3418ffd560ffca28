"""After a hit: the op, line and element of a value born in code outside every watched call.

`_record.outside` kept, for the step, every torch call made outside the watched root calls
(function, arguments by reference, outputs, the user's line) and the arguments of each
``backward()``. Here those calls are replayed in order — tensors made by an earlier recorded call
are replaced by their replayed values, every other tensor (the model's outputs, the data, a loss
module's parameters) by a detached copy — so the replay never writes to the user's tensors.

Forward: the replay runs under `oplevel`'s recorder (each aten op tagged with the line of the call
being replayed); from the reported element we walk back to the op that created the value.
Backward: the replay runs with grad; each autograd node it creates belongs to the recorded call
that created it; the recorded ``backward()`` seeds run through ``torch.autograd.grad`` (no
``.grad`` is touched) with a hook on every one of those nodes: the creator is the first node that
produced a non-finite gradient from finite ones. The RNG is restored afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .._finding import Finding
from .._steplog import Out, OutRec, StepLog, Top
from .._tensors import Path, dtype_name, element, get_path, is_bad, shape_of, tensors, values
from . import hints as _hints
from .differential import _FROM_ZERO, REDUCED, _underflow_ref
from .graph import _source, node_of_frame
from .nodes import blame_nodes, checked_hook, hook_names, named
from .oplevel import OpOrigin, _chain, _first, _Recorder
from .replay import faithful, given_objects

__all__ = ["OUTSIDE", "Born", "forward_origin", "backward_origin", "producer", "forward_finding", "in_place",
           "backward_finding", "check_origin", "writer"]

OUTSIDE = "<outside>"


@dataclass
class Born:
    """Where a gradient of the outside code was born (backward)."""

    op: str
    source: str | None
    function: str
    rec: int
    grad: torch.Tensor
    slot: int
    chain: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    node: str = ""  # the node's name (op differs for a custom Function's node: the op in its backward)


_REGISTER_HOOK = torch.Tensor.register_hook


class _Tag(TorchDispatchMode):
    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec
        self.src: str | None = None
        self.on = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.on:
            return func(*args, **kwargs)
        # a compiled function in the loss code (recorded as one call): its op's line is its graph node's
        node = node_of_frame()
        src = _source(node.meta.get("stack_trace")) if node is not None else None
        return self.rec.record(func, args, kwargs, src or self.src)


class _Replay:
    """``wide``: the float32 reference of the recorded code: float16/bfloat16/float8 tensors come in
    as float32, casts to them (``.half()``, ``.to(torch.float16)``, a ``dtype=`` argument) keep
    float32, and autocast stays off."""

    def __init__(self, recs: list[OutRec], grad: bool, returned: dict[int, torch.Tensor] | None = None,
                 wide: bool = False, tops: list[tuple[int, Top, list[tuple[torch.Tensor, Path]]]] | None = None) -> None:
        self.recs = recs
        self.grad = grad
        self.wide = wide
        # watched top-level calls between the recorded ones (`_watched_between`): run again where one
        # takes a value the recorded code made, so that a backward reaches that code through them
        self.tops = list(tops or ())
        self.made: set[int] = set()  # ids of the user's tensors that a recorded call made
        self.returned = returned or {}  # id of a watched call's output written in place since -> its value at the return
        self.sub: dict[int, torch.Tensor] = {}
        self.keep: list[torch.Tensor] = []
        self.leaves: list[torch.Tensor] = []
        # outputs of watched calls run again (`_top`): the backward must reach them too, else the
        # recorded code after a call fed by recorded code (``model(x + 1)``) is pruned from it
        self.rerun: list[torch.Tensor] = []
        self.outs: list[list[torch.Tensor]] = []
        self.node_rec: dict[Any, int] = {}
        # gradient hooks the recorded code registered (``z.register_hook(fn)``): (fn, record, the
        # gradient it returned) for the first that turned a finite gradient non-finite (`nodes.checked_hook`)
        self.hook_made: list[tuple[Any, int, torch.Tensor]] = []

    def ext(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        r = self.sub.get(id(x))
        if r is not None:
            return r
        with torch.no_grad():
            c = self.returned.get(id(x), x).detach().clone()
            if self.wide and str(c.dtype).removeprefix("torch.") in REDUCED:
                c = c.float()
        if self.grad and x.requires_grad and (x.is_floating_point() or x.is_complex()):
            c.requires_grad_(True)
            self.leaves.append(c)
            with torch.enable_grad():
                r = c.clone()  # a non-leaf: the user's code may write into it
        else:
            r = c
        self.sub[id(x)] = r
        self.keep.append(x)
        return r

    def run(self, upto: int, tag: _Tag | None) -> None:
        known: set[Any] = set()
        for i, r in enumerate(self.recs[: upto + 1]):
            while self.tops and self.tops[0][0] <= i:
                _, top, held = self.tops.pop(0)
                self._top(top, held)
            if r.func is None:  # released (known finite, no backward): later calls hold their own inputs
                self.outs.append([])
                continue
            if r.rng is not None:
                torch.set_rng_state(r.rng)
            if tag is not None:
                tag.on = False
            args = tree_map(self.ext, r.args)
            kwargs = tree_map(self.ext, r.kwargs)
            func = r.func
            if self.grad and func is _REGISTER_HOOK and len(args) > 1 and callable(args[1]):
                args = (args[0], checked_hook(args[1], self.hook_made, i), *args[2:])
            if self.wide:
                args, kwargs = tree_map(_wide_dtype, (args, kwargs))
                if getattr(func, "__name__", "") in _NARROWING and args and isinstance(args[0], torch.Tensor):
                    func = _same_tensor  # x.half(): x stays float32
            if self.grad:
                known.update(t.grad_fn for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            if tag is not None:
                tag.src = r.src
                tag.on = True
            with contextlib.ExitStack() as casts:
                for dev, dtype in r.autocast:  # as the call ran (a loss under torch.autocast)
                    casts.enter_context(torch.autocast(dev, dtype=dtype, enabled=not self.wide))
                if self.wide:  # (the analysis may run inside the user's own autocast block)
                    for dev in ("cpu", "cuda"):
                        casts.enter_context(torch.autocast(dev, enabled=False))
                out = func(*args, **kwargs)
            if (self.wide and isinstance(out, torch.Tensor) and args and out is args[0]
                    and isinstance(r.out, torch.Tensor) and r.args and r.out is not r.args[0]):
                out = out.clone()  # (x.half() made a copy; the float32 x.float() is x: a write into it is not x's)
            if tag is not None:
                tag.on = False
            if out is None and getattr(r.func, "__name__", "") == "__setitem__":
                out = args[0]
                orig = r.args[0]
            else:
                orig = r.out
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            origs = [t for t in tree_leaves(orig) if isinstance(t, torch.Tensor)]
            for o, n in zip(origs, outs):
                self.sub[id(o)] = n
                self.made.add(id(o))
                self.keep.append(o)
            self.outs.append(outs)
            if self.grad:
                todo = [t.grad_fn for t in outs]
                while todo:
                    fn = todo.pop()
                    if fn is None or fn in known or fn in self.node_rec:
                        continue
                    self.node_rec[fn] = i
                    todo.extend(n for n, _ in fn.next_functions)

    def _top(self, top: Top, outs: list[tuple[torch.Tensor, Path]]) -> None:
        """A watched top-level call that took a value the recorded code made (``h = self.enc(x)``,
        code of the user's, then ``self.head(h)``: a Lightning ``training_step``): run again on the
        replayed values, its outputs standing for the ones the later recorded calls took."""
        given = [t for _, t in tensors((top.args, top.kwargs or {}))]
        if not outs or not any(id(t) in self.made for t in given):
            return  # (nothing of the recorded code goes into it: its outputs stay what they were)
        try:
            args, kwargs = given_objects(tree_map(self.ext, (top.args, top.kwargs or {})))
            with faithful(top), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = top.module(*args, **kwargs)
        except Exception:
            return
        for orig, path in outs:
            try:
                new = get_path(out, path)
            except (LookupError, AttributeError, TypeError):
                continue
            if isinstance(new, torch.Tensor):
                if self.grad and new.requires_grad:
                    self.rerun.append(new)
                self.sub[id(orig)] = new
                self.made.add(id(orig))  # (a later watched call it feeds runs again too)
                self.keep.append(orig)


def _watched_between(log: StepLog) -> list[tuple[int, Top, list[tuple[torch.Tensor, Path]]]]:
    """The step's watched top-level calls, each with the recorded call it began before
    (`Top.outside_at`) and its output tensors (and their paths), for `_Replay`'s ``tops``."""
    got = []
    for c in log.calls:
        if c.depth != 0 or not c.out_keys or not 0 <= c.top < len(log.tops):
            continue
        outs = [(t, path) for k, path in c.out_keys if (t := log.tensors[k].ref()) is not None]
        got.append((log.tops[c.top].outside_at, log.tops[c.top], outs))
    return sorted(got, key=lambda x: x[0])


_NARROWING = frozenset({"half", "bfloat16"})  # Tensor methods that cast to a reduced dtype


def _same_tensor(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x


def _wide_dtype(x: Any) -> Any:
    """A reduced floating dtype named in a call's arguments, as float32 (the wide replay)."""
    if isinstance(x, torch.dtype):
        return torch.float32 if str(x).removeprefix("torch.") in REDUCED else x
    if isinstance(x, (type, str)):  # x.type(torch.HalfTensor), x.type("torch.cuda.BFloat16Tensor")
        name = x if isinstance(x, str) else f"{getattr(x, '__module__', '')}.{getattr(x, '__name__', '')}"
        if name.startswith("torch.") and name.endswith(_LEGACY):
            wide = name.rsplit(".", 1)[0] + ".FloatTensor"
            if isinstance(x, str):
                return wide
            return torch.cuda.FloatTensor if wide.startswith("torch.cuda.") else torch.FloatTensor  # type: ignore[attr-defined]
    return x


_LEGACY = (".HalfTensor", ".BFloat16Tensor")  # the legacy tensor types of a reduced dtype


def reference32(recs: list[OutRec], ri: int, j: int, index: tuple[int, ...] | None,
                returned: dict[int, torch.Tensor] | None = None
                ) -> tuple[bool, float | None, tuple[str, float] | None] | None:
    """The recorded code up to call ``ri`` replayed in float32 (`_Replay`'s ``wide``): is output
    ``j`` non-finite there too, its value at ``index``, and the first subtraction before it that the
    failing run rounded to 0 where float32 is not (``1 - sigmoid(z)`` in bfloat16: its name and
    float32 value). None when it cannot be replayed."""
    try:
        rep = _Replay(recs, grad=False, returned=returned, wide=True)
        with _rng(), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep.run(ri, None)
        outs = rep.outs[ri]
        if j >= len(outs):
            return None
        w = outs[j]
        value = None
        if index is not None and len(index) == w.dim() and all(0 <= i < s for i, s in zip(index, w.shape)):
            value = float(w[index])
        return is_bad(w), value, _cancelled(recs, rep.outs, ri)
    except Exception:
        return None


def _cancelled(recs: list[OutRec], wide: list[list[torch.Tensor]], ri: int) -> tuple[str, float] | None:
    """The first recorded call before ``ri`` whose reduced-precision output holds a 0 where its
    float32 replay does not: a subtraction at any size (``1 - sigmoid(z)`` in bfloat16: both sides
    round to one value), any other call where that value is below the dtype's smallest normal one
    (``x.half().softmax(-1)`` of a probability of 1e-9: an underflow). Its aten name and float32 value."""
    with torch.no_grad():
        for r, outs in zip(recs[:ri], wide):
            name = getattr(r.func, "__name__", "").strip("_")
            for u, w in zip(_outs(r), outs):
                if str(u.dtype).removeprefix("torch.") in REDUCED and u.shape == w.shape:
                    lost = (u == 0) & (w != 0)
                    if name not in ("sub", "rsub"):
                        lost &= w.abs() < torch.finfo(u.dtype).tiny
                    if bool(lost.any()):
                        return f"aten.{name}", float(w[lost][0])
    return None


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` is ``a`` or a detached alias of it (``hunt.check`` keeps ``tensor.detach()``)."""
    if a is b:
        return True
    if a.layout is not torch.strided or b.layout is not torch.strided or a.is_nested or b.is_nested:
        return False  # (no data_ptr: a sparse or nested tensor is only ever itself)
    return a.data_ptr() == b.data_ptr() != 0 and a.shape == b.shape and a.dtype == b.dtype


def output_of(log: StepLog, e: Any) -> torch.Tensor | None:
    outs = _outs(log.outside[e.rec])
    return outs[e.out] if e.out < len(outs) else None


def producer(recs: list[OutRec], t: torch.Tensor) -> tuple[int, int] | None:
    """The recorded call (and output number) that made ``t``."""
    for i in range(len(recs) - 1, -1, -1):
        for j, o in enumerate(_outs(recs[i])):
            if same(o, t):
                return i, j
    return None


def forward_origin(recs: list[OutRec], ri: int, j: int,
                   returned: dict[int, torch.Tensor] | None = None,
                   at: tuple[int, ...] | None = None) -> tuple[OpOrigin | None, dict[str, Any]]:
    """Op, line and chain of the first non-finite value in output ``j`` of recorded call ``ri``
    (of element ``at`` when given, if non-finite in the replay); and what the hints need (the
    reduction's input rows). ``returned``: the values at their call's return of watched outputs
    the code wrote in place since (``out.mul_(s)``), from the root's replay: the replay starts
    from them, not from what they hold now."""
    facts: dict[str, Any] = {}
    try:
        rep = _Replay(recs, grad=False, returned=returned)
        rec = _Recorder()
        tag = _Tag(rec)
        with _rng(), torch.no_grad(), warnings.catch_warnings(), tag:
            warnings.simplefilter("ignore")  # the user's code warned once already
            rep.run(ri, tag)
        outs = rep.outs[ri]
        if j >= len(outs):
            return None, facts
        t = outs[j]
        code, prod = rec.lookup(t)
        if code is None and prod is not None:
            # finite in the replay: its inputs were written in place since (clip_grad_norm_ scales
            # the gradients whose norm overflowed). The call's own op made it, if it is one op
            name = getattr(recs[ri].func, "__name__", "")
            ops = [x.op for x in rec.recs[: prod[0] + 1] if x.op.split(".")[1:2] == [name]]
            if ops:
                src = recs[ri].src
                facts = {"unreplayed": True}
                return OpOrigin(ops[-1], src, [f"{ops[-1]} @ {src}" if src else ops[-1]], facts), facts
        if code is None or prod is None:
            return None, facts
        start = at if at is not None and len(at) == code.dim() and bool(code[at]) else _first(code)
        got = rec.walk(prod, start)
        if not got:
            return None, facts
        first = rec.recs[got[0]]
        # (replayed under no_grad: a value the loss code computed from the model's outputs is no constant)
        rec.graded = {id(rep.sub[id(o)]) for o in rep.keep if o.requires_grad and id(o) in rep.sub}
        facts = _hints.facts(rec, got)
        if (facts.get("log_zero") and first.op.split(".")[1:2] == ["log"] and first.call is not None
                and id(first.call[1][0]) not in rec.graded and any(o.requires_grad for r in recs for o in _outs(r))):
            facts["log_data"] = True  # loss code that trains the model, this log of nothing it made: a target from the data
            if getattr(first.call[1][0], "ndim", None) == 0:
                facts["log_scalar"] = True  # one number: a coefficient of the loop's (mixup's lam), no target
        return OpOrigin(first.op, first.src, _chain(rec, got), facts), facts
    except Exception:
        return None, facts


class _rng:
    """The user's CPU RNG stream is left as it was; each recorded call that was the first after a
    root call starts from the state it saw."""

    def __enter__(self) -> None:
        self.saved = torch.get_rng_state()

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self.saved)


def backward_origin(recs: list[OutRec], seeds: list[tuple[Any, Any, str | None]],
                    tops: list[tuple[int, Top, list[tuple[torch.Tensor, Path]]]] | None = None) -> Born | None:
    """The autograd node of the outside code that made the first non-finite gradient. ``tops``:
    the watched calls among the recorded ones (`_watched_between`), run again where they take a
    value the recorded code made."""
    try:
        return _backward_origin(recs, seeds, tops)
    except Exception:
        return None


def _backward_origin(recs: list[OutRec], seeds: list[tuple[Any, Any, str | None]],
                     tops: list[tuple[int, Top, list[tuple[torch.Tensor, Path]]]] | None = None) -> Born | None:
    if not recs or not seeds:
        return None
    rep = _Replay(recs, grad=True, tops=tops)
    with _rng(), torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep.run(len(recs) - 1, None)
    roots: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for args, kwargs, _src in seeds:
        ts, gs = _seed(args, kwargs)
        for t, g in zip(ts, gs):
            r = rep.sub.get(id(t))
            if r is None or not r.requires_grad:
                continue
            roots.append(r)
            grads.append(torch.ones_like(r) if g is None else rep.sub.get(id(g), g))
    if not roots:
        return None
    leaves = rep.leaves
    if any(is_bad(x) for x in leaves):
        return None  # the loss code was fed non-finite values (a poisoned forward): its backward only carries them
    ends = leaves + rep.rerun  # (a watched call run again holds no leaf of the replay: its outputs stand for one)

    def run() -> None:
        torch.autograd.grad(roots, ends, grads, allow_unused=True)

    if not ends:
        return None
    got = blame_nodes(list(rep.node_rec), run)
    if got is None and rep.hook_made:  # no node made it: a gradient hook the code registered did
        fn, ri, grad = rep.hook_made[0]
        return Born("", recs[ri].src, "register_hook", ri, grad, 0,  # (no op: the user's hook)
                    facts={"tensor_hook": hook_names([fn]), "registered": True})
    if got is None:
        return None
    ri = rep.node_rec[got.fn]
    op, src, names, facts = named(got._replace(chain=[n for n in got.chain if n in rep.node_rec]),
                                  lambda n: recs[rep.node_rec[n]].src, recs[ri].src)
    return Born(op, src, recs[ri].fn, ri, got.grad, got.slot, names, facts, got.fn.name())


def _seed(args: Any, kwargs: Any) -> tuple[list[Any], list[Any]]:
    if not args:
        return [], []
    first = args[0]
    if isinstance(first, torch.Tensor) and ("gradient" in kwargs or len(args) < 2 or not isinstance(args[1], (list, tuple))):
        g = kwargs.get("gradient", args[1] if len(args) > 1 else None)
        return [first], [g]
    ts = [first] if isinstance(first, torch.Tensor) else list(first)
    gs = kwargs.get("grad_tensors", args[1] if len(args) > 1 else None)
    if gs is None:
        gs = [None] * len(ts)
    elif isinstance(gs, torch.Tensor):
        gs = [gs]
    return ts, list(gs)


# ---------------------------------------------------------------- findings
def _outs(r: OutRec) -> list[torch.Tensor]:
    out = r.args[0] if r.out is None and r.args else r.out
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def forward_finding(log: StepLog, step: int, rec_i: int, out_i: int, grads: frozenset[int] = frozenset(),
                    returned: dict[int, torch.Tensor] | None = None) -> Finding | None:
    """Output ``out_i`` of the recorded outside call ``rec_i`` was the first non-finite value.
    ``grads``: ids of the watched parameters' ``.grad`` tensors (never fed from outside);
    ``returned``: see `forward_origin`."""
    r = log.outside[rec_i]
    outs = _outs(r)
    if out_i >= len(outs) or not is_bad(outs[out_i]):
        return None  # finite values whose sum overflowed
    t = outs[out_i]
    if not _loss_bad(log) and _dropped_later(log, rec_i, t):
        return None  # (a guarded metric's 0/0, p * log p at p = 0 under a where: harmless, as it was meant)
    leaves = tree_leaves((r.args, r.kwargs))
    name = getattr(r.func, "__name__", "")
    if not in_place(name) and any(x is t for x in leaves):
        return None  # an input handed back unchanged (.to() its own device): not born here
    bad_in = [x for x in leaves if isinstance(x, torch.Tensor) and x is not t and is_bad(x)]
    masks_nan = False
    if not bad_in and in_place(name) and not bool(torch.isnan(values(t)).any()) and _held_before(log, rec_i, t):
        # what it wrote into held them already (a -inf mask set to 0 where allowed): carried on. A
        # NaN it made of them is born here (in-place arithmetic on a NaN or +inf is never judged)
        return None
    if bad_in:
        fed = [x for x in bad_in if _feeds(x)]
        if not fed:
            data = next((x for x in bad_in if not _mask_like(x) and _foreign(log, x, grads, minus=True)), None)
            if (data is None and _loss_bad(log) and bool((values(t) == math.inf).any()) and not bool(torch.isnan(t).any())
                    and all(_foreign(log, x, grads, through=True) for x in bad_in)):
                # a -inf the data brought through this code's arithmetic with the model's outputs
                # (|target - out| of a -inf target: the box regression target log(w_gt / w_anchor) of a
                # box of width 0) made +inf here on the way to the loss: no mask is used so
                data = bad_in[0]
            if data is not None and _feeds(t):
                # a -inf among values other than 0, from nothing this step made: the data's log of 0
                # (a log-transformed target with a 0), no mask; fed, as a NaN in the batch is
                return _fed_finding(log, step, rec_i, out_i, t, data)
            # only -inf went in, a mask's value by design: born here if this op turned it into a
            # NaN (softmax of a fully masked row) or reduced a row to nothing but it (logsumexp,
            # max over a fully masked row), else it only carries the mask on
            nan = bool(torch.isnan(t).any())
            masks_nan = nan  # (its -infs are the mask's, carried on: the NaN it made is the element to show)
            if not (nan or (t.numel() < max(x.numel() for x in bad_in) and _loss_bad(log))):
                return None  # (a row reduced to -inf that the code filters out: no loss is harmed)
            if any(_model_made(log, x) for x in bad_in):
                return None  # the model's own -inf (log of 0 in it, unprobed in sentinel): its replay says where
        elif all(_foreign(log, x, grads) for x in fed):
            return _fed_finding(log, step, rec_i, out_i, t, fed[0])  # non-finite from nothing this step made
        elif all(_constant(log, x) for x in fed):
            # only a NaN/+inf constant this code wrote went in (torch.tensor(nan) as a default,
            # full_like(x, inf)): markers and caps by design, unless they reach what the step
            # trains on (a backward() of a non-finite loss); then, as for a -inf mask, born here
            # when this op reduced a row to it (a mean of a where(..., nan)) or turned it into a
            # NaN, else it only carries it on
            carried = bool(torch.isnan(t).any()) <= any(bool(torch.isnan(x).any()) for x in fed)
            if not _loss_bad(log) or (carried and t.numel() >= max(x.numel() for x in fed)):
                return None
        else:
            return None  # fed: not born here (an earlier op, a watched or ignored module's output); found where it flows
    if any(isinstance(x, float) and not math.isfinite(x) for x in leaves) and not bad_in and not (
            t.grad_fn is not None and any(isinstance(x, float) and math.isnan(x) for x in leaves)
            and bool(torch.isnan(t).all()) and _loss_bad(log)):
        # an infinity the code wrote on purpose (max_norm=inf, a -inf mask value, nan markers);
        # not a NaN literal that made all of a differentiated value NaN (loss * nan) on the way
        # to a non-finite loss
        return None
    index, value, counts = element(t)
    if masks_nan and t.layout == torch.strided and not t.is_nested and not t.is_complex() and t.dim():
        # a fully masked row made nan among the other rows' carried -inf (x - logsumexp(x): Categorical's
        # logits): its first NaN, not the first masked position of a row that is fine
        with torch.no_grad():
            i = int(torch.isnan(t.detach()).reshape(-1).nonzero()[0, 0])
        index, value = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), t.shape)), math.nan
    got, fx = forward_origin(log.outside, rec_i, out_i, returned, at=index if masks_nan else None)
    tensor = "output" if len(outs) == 1 else f"output[{out_i}]"
    dtype = dtype_name(t)
    # float32/float64 code outside autocast, reproduced by its replay: that replay is the float32
    # eager reference, so the verdict is the math itself (as a module's float32 finding gets)
    numerics = got is not None and not fx.get("unreplayed") and dtype in ("float32", "float64") and not r.autocast
    verdict: str | None = "numerics" if numerics else None
    reference: dict[str, Any] = ({"dtype": dtype, "op": got.op if got is not None else None, "tensor": tensor,
                                  "value": value} if numerics else {})
    if got is not None and not fx.get("unreplayed") and (dtype in REDUCED or r.autocast):
        # float16/bfloat16 code, or code under autocast: the float32 reference is the same calls
        # replayed in float32, autocast off
        ref = reference32(log.outside, rec_i, out_i, index, returned)
        if ref is not None:
            bad32, value32, cut = ref
            reference = {"dtype": "float32", "op": got.op, "tensor": tensor, "value": value32}
            if bad32:
                verdict = "numerics"
            else:
                verdict = "precision"
                low = dtype if dtype in REDUCED else next(
                    (str(d).removeprefix("torch.") for _, d in r.autocast if str(d).removeprefix("torch.") in REDUCED),
                    dtype)
                if low in REDUCED:
                    reference.update(limit=float(torch.finfo(getattr(torch, low)).max), failing_dtype=low)
                reference["failing"] = value
                if cut is not None and (got.op or "").split(".")[1:2] in ([z] for z in _FROM_ZERO):  # (fed a 0)
                    reference = _underflow_ref(cut[0], cut[1], float(torch.finfo(getattr(torch, low)).tiny),
                                               getattr(torch, low))
    f = Finding(
        phase="forward", module=OUTSIDE, module_type=r.fn or OUTSIDE, tensor=tensor,
        step=step, call=_nth(log.outside, rec_i), index=index, value=value, counts=counts, shape=shape_of(t),
        dtype=dtype, cause="created",
        op=got.op if got is not None else None, source=got.source if got is not None else r.src,
        chain=tuple(got.chain) if got is not None else (),
        reproducible=True if got is not None and not fx.get("unreplayed") else None,
        verdict=verdict, reference=reference,
    )
    batch = log.tops[-1].batch() if log.tops else None  # (the loss code's rows: the last batch's samples)
    return dataclasses.replace(f, hint=_hints.hint(f, {**fx, "batch": batch}))


# calls that drop elements (select, overwrite, replace them): a finite output of one from a
# non-finite input left the non-finite elements out; and elementwise functions that saturate at
# +-inf, whose finite value there is their limit (a metric's atan(w / h) of a box of height 0:
# pi/2; a softmax's 0 for a -inf, hand-made Gumbel noise -log(-log(u)) at u = 0). (Arithmetic
# that makes finite values of an inf, max_norm / inf = 0 in clip_grad_norm_, changed the finite
# ones: not dropped.)
_DROPPING = frozenset({"where", "masked_fill", "masked_fill_", "nan_to_num", "nan_to_num_", "__getitem__",
                       "__setitem__", "masked_select", "index_select", "nansum", "nanmean",
                       "atan", "arctan", "tanh", "sigmoid", "softmax"})


def _dropped_later(log: StepLog, ri: int, t: torch.Tensor, most: int = 64) -> bool:
    """Every value the later recorded calls made from ``t`` (output of call ``ri``) is finite again
    where a call that drops elements (`_DROPPING`) made it, and each non-finite one on the way was
    used by a later call: the non-finite elements were dropped (a metric's ``torch.where(d > 0,
    n / d, 0)``, ``p * log p`` at p = 0 under a where), so nothing this code handed on held them. A
    non-finite value no later call used may have gone anywhere (the model, the user's variables):
    not dropped, nor one only looked at (``if not torch.isfinite(loss): continue``, ``.tolist()``);
    nor when more than ``most`` values would have to be followed."""
    recs = log.outside
    leaves = [[a for a in tree_leaves((r.args, r.kwargs)) if isinstance(a, torch.Tensor)] for r in recs[ri + 1:]]
    todo, seen = [(ri, t)], {(ri, id(t))}
    while todo:
        i, x = todo.pop()
        users = [j for j in range(i + 1, len(recs)) if any(a is x for a in leaves[j - ri - 1])]
        valued = False  # a later call made values of x (not only masks of it)
        for j in users:
            for o in _outs(recs[j]):
                if not (o.is_floating_point() or o.is_complex()):
                    continue  # (a mask made of it, isfinite(x): holds no value of it)
                valued = True
                if (j, id(o)) in seen:
                    continue
                if not is_bad(o):
                    if getattr(recs[j].func, "__name__", "") not in _DROPPING:
                        return False
                    continue
                if len(seen) >= most:
                    return False
                seen.add((j, id(o)))  # (an in-place write hands x on as itself: followed from j)
                todo.append((j, o))
        if not valued:
            return False  # unused, or only looked at: still held as it was
    return True


def _feeds(x: torch.Tensor) -> bool:
    """Holds a NaN or +inf (a -inf alone is a mask's value by design)."""
    x = values(x)
    return bool(torch.isnan(x).any()) or bool((x == float("inf")).any())


def _mask_like(x: torch.Tensor) -> bool:
    """Its finite values are all 0 (an additive mask of 0 and -inf), or it has none."""
    x = values(x)
    return bool(x[torch.isfinite(x)].eq(0).all())


def _aliases(a: torch.Tensor, x: torch.Tensor) -> bool:
    """``x`` is a view of ``a`` (the same storage)."""
    return a.layout == x.layout == torch.strided and a.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _foreign(log: StepLog, x: torch.Tensor, grads: frozenset[int], depth: int = 0, minus: bool = False,
             through: bool = False) -> bool:
    """``x`` came from nothing this step made: the data, an unwatched module's weights, a tensor
    kept from an earlier step; also through code here that only took it apart (``Y[k]``, a
    ``.view``). Not an output of a watched or ignored module, not anything autograd tracks (the
    model's own outputs in sentinel mode, unprobed), not a gradient (``grads``: ids of ``.grad``
    tensors; what ``torch.autograd.grad`` returned). ``minus``: a -inf followed too, not only a
    NaN or +inf, where the code only took it apart (a view of it; a sum with a bias is made here).
    ``through``: a -inf followed also through this code's arithmetic with the model's outputs
    (``target - out``: every non-finite value in it came from the target)."""
    if (x.grad_fn is not None and not through) or id(x) in grads or any(r() is x for r in log.grads_out):
        return False
    got = producer(log.outside, x)
    while got is not None and any(isinstance(a, torch.Tensor) and a is not x and same(a, x)
                                  for a in tree_leaves((log.outside[got[0]].args, log.outside[got[0]].kwargs))):
        got = producer(log.outside[:got[0]], x)  # an alias of its own input (y.view(-1, 1) of an (n, 1) y): x is that input
    if got is None and x.grad_fn is not None:
        return False  # (``through``: made by the model, or by autograd-tracked code this step did not record)
    if got is not None:  # made by this code from what it was fed: foreign if all of that was
        if depth >= 8:
            return False
        r = log.outside[got[0]]
        ins = [a for a in tree_leaves((r.args, r.kwargs)) if isinstance(a, torch.Tensor) and a is not x and is_bad(a)]
        return bool(ins) and all((_feeds(a) or through or (minus and _aliases(a, x)))
                                 and _foreign(log, a, grads, depth + 1, minus, through) for a in ins)
    key = (id(x), -1 if x.is_inference() else x._version)
    ref = log.probed.get(key)
    if log.is_ignored(x) or (ref is not None and ref() is x):
        return False
    return not any(r() is x for c in log.calls for r, _ in c.outs)


def writer(log: StepLog, t: torch.Tensor) -> str | None:
    """The line of the code outside the model that wrote a non-finite value into ``t`` in place
    during the step (``p.data[3] = nan``, which no version counter sees); None when there is none."""
    rec = written_at(log, (t,))
    return log.outside[rec].src if rec is not None else None


def written_at(log: StepLog, ts: Iterable[torch.Tensor]) -> int | None:
    """The first in-place call (its index in ``StepLog.outside``) of the code outside the model
    into the storage of one of ``ts`` whose probe was non-finite; None when there is none."""
    ptrs = {_ptr(t) for t in ts} - {0}
    if not ptrs:
        return None
    try:
        sbad, _ = log.bad_flags()
        for e, b in zip(log.meta, sbad):
            if not b or not isinstance(e, Out) or e.rec >= len(log.outside):
                continue
            r = log.outside[e.rec]
            outs = _outs(r)
            if in_place(getattr(r.func, "__name__", "")) and e.out < len(outs) and _ptr(outs[e.out]) in ptrs:
                return e.rec
    except Exception:  # (nothing to tell)
        return None
    return None


def _ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # (a tensor without storage)
        return 0


def _held_before(log: StepLog, ri: int, t: torch.Tensor) -> bool:
    """An earlier recorded call's output in ``t``'s storage was non-finite when it was probed: what
    the in-place call ``ri`` wrote into already held non-finite values (``full_like(x, -inf)``,
    then ``mask[:, allowed] = 0``)."""
    try:
        ptr = t.untyped_storage().data_ptr()
        sbad, _ = log.bad_flags()
        for e, b in zip(log.meta, sbad):
            if b and isinstance(e, Out) and e.rec < ri:
                outs = _outs(log.outside[e.rec])
                if ptr and e.out < len(outs) and outs[e.out].untyped_storage().data_ptr() == ptr:
                    return True
    except Exception:  # (a tensor without storage: nothing to tell)
        return False
    return False


def in_place(name: str) -> bool:
    """A torch call of this name writes into its first argument (``add_``, ``x[i] = v``)."""
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))


def _loss_bad(log: StepLog) -> bool:
    """A ``backward()`` of this step started from a non-finite value (the loss it trains on)."""
    return any(isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and is_bad(x)
               for args, kwargs, _ in log.seeds for x in tree_leaves((args, kwargs)))


def _constant(log: StepLog, x: torch.Tensor, depth: int = 0) -> bool:
    """``x`` holds non-finite values only because this code wrote them on purpose: made by a
    recorded call from a non-finite literal (``torch.tensor(nan)``, ``full_like(x, inf)``) and no
    non-finite tensor, or carried on from such values by later recorded calls."""
    got = producer(log.outside, x)
    if got is None or depth >= 8:
        return False
    r = log.outside[got[0]]
    if in_place(getattr(r.func, "__name__", "")):
        return False  # written into a tensor that was there (a weight poisoned by hand): not a constant
    leaves = tree_leaves((r.args, r.kwargs))
    ins = [a for a in leaves if isinstance(a, torch.Tensor) and a is not x and is_bad(a)]
    if not ins:
        return any(isinstance(a, float) and not math.isfinite(a) for a in leaves)
    return all(_constant(log, a, depth + 1) for a in ins)


def _model_made(log: StepLog, x: torch.Tensor) -> bool:
    """``x`` is an output of the watched model that no probe judged (sentinel mode: the root's
    outputs in training reach the loss code unprobed), not something this code or an ignored
    module made."""
    if x.grad_fn is None or producer(log.outside, x) is not None:
        return False
    return not log.is_ignored(x)


def _fed_finding(log: StepLog, step: int, rec_i: int, out_i: int, t: torch.Tensor, x: torch.Tensor) -> Finding:
    """Code outside the watched calls was fed a NaN/+inf that nothing of this step made (``x``,
    one of its arguments): its first use is reported, cause ``input``."""
    r = log.outside[rec_i]
    outs = _outs(r)
    index, value, counts = element(t)
    where, bad, _ = element(x)
    leaves = tree_leaves((r.args, r.kwargs))
    arg = next((i for i, a in enumerate(leaves) if a is x), 0)
    name = getattr(r.func, "__name__", None) or r.fn or "this call"
    return Finding(
        phase="forward", module=OUTSIDE, module_type=r.fn or OUTSIDE, tensor="output" if len(outs) == 1 else f"output[{out_i}]",
        step=step, call=_nth(log.outside, rec_i), index=index, value=value, counts=counts, shape=shape_of(t),
        dtype=dtype_name(t), cause="input", op=None, source=r.src, chain=(), reproducible=None,
        hint=f"{name} was fed a non-finite value that nothing watched made in this step: its tensor argument "
             f"{arg} (shape {tuple(x.shape)}) holds {bad} at index {where}. It came from outside the watched model: "
             "the data (a NaN in the batch or its targets), an unwatched module's weights (an EMA or teacher "
             "model updated after step()), or a tensor kept from an earlier step. Check the data, or watch that "
             "module too, to see where it was born." + (
                 " A -inf in the data is most often log of 0: a log-transformed target or feature that holds a 0 "
                 "(take log1p, or clamp_min(eps) before the log, where the data is made)." if bad == float("-inf") else ""),
    )


def backward_finding(log: StepLog, step: int) -> Finding | None:
    """The outside code's backward made the first non-finite gradient (a loss function's)."""
    if not log.outside or not log.seeds:
        return None
    b = backward_origin(log.outside, log.seeds, _watched_between(log))
    if b is None:
        return None
    index, value, counts = element(b.grad)
    tensor = f"{b.node}.grad_input[{b.slot}]" if b.node else f"grad_input[{b.slot}]"
    dtype = dtype_name(b.grad)
    # float32/float64 code outside autocast: its eager replay is the float32 reference, so the
    # verdict is the math itself (as a module's node-level finding, or this code's forward one, gets)
    numerics = dtype in ("float32", "float64") and not log.outside[b.rec].autocast
    f = Finding(
        # the gradient its node made (as a module's node-level finding names it), not what reached the model
        phase="backward", module=OUTSIDE, module_type=b.function or OUTSIDE, tensor=tensor,
        step=step, call=_nth(log.outside, b.rec), index=index, value=value, counts=counts, shape=shape_of(b.grad),
        dtype=dtype, cause="created", op=b.op or None, source=b.source, chain=tuple(b.chain),
        reproducible=True, verdict="numerics" if numerics else None,
        reference={"dtype": dtype, "op": b.op or None, "tensor": tensor, "value": value} if numerics else {},
    )
    return dataclasses.replace(f, hint=_hints.hint(f, b.facts))


def _nth(recs: list[OutRec], i: int) -> int:
    """Which run of its line within the step (0: the first): a loop's second pass is call 1."""
    return sum(1 for r in recs[:i] if r.src == recs[i].src and r.func is recs[i].func)


def check_origin(log: StepLog, t: torch.Tensor) -> tuple[OpOrigin | None, dict[str, Any]]:
    """Op, line and chain of a tensor given to ``hunt.check``, when recorded outside code made it."""
    got = producer(log.outside, t)
    if got is None:
        return None, {}
    return forward_origin(log.outside, *got)
