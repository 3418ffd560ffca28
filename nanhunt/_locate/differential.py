"""Differential replay after a hit: what kind of failure it is, and what a reference run saw.

The failing top-level call is replayed (each replay inside :func:`nanhunt._locate.replay.faithful`:
same inputs, RNG, grad mode; buffers and the user's RNG put back) in the failing configuration, to
learn whether it reproduces and whether identical replays agree, then in reference configurations:
eager instead of compiled (``torch.compiler.set_stance("force_eager")``), and float32 instead of
float16/bfloat16: the failing module call is run alone on the inputs the replay gave it (as the call
began, each run on its own copy: a call changes a KV cache it is given), from the RNG state it
started at, once as it failed and once in float32 (float32 copies of that module's own
parameters and of its inputs through ``torch.func.functional_call``, autocast off, deterministic
algorithms), both under a dispatch mode that keeps every op's output. The two runs are compared op
by op: the first op whose float32 value passes the largest value of the dtype it ran in when the
run failed (or a cast down to that dtype whose input did) is the op that overflowed. Only the
failing module's parameters are ever copied to float32.

Verdicts (``Finding.verdict``): ``"numerics"`` (non-finite in float32 eager too), ``"precision"``
(finite in float32), ``"compiler"`` (only compiled), ``"nondeterministic"`` (identical replays
disagree), ``"transient"`` (no replay reproduces it). A graph whose random numbers Inductor drew with
its own generator is judged on the numbers it drew (:mod:`nanhunt._locate.inductor`), not against an
eager replay that drew others; where they cannot be had, no verdict. Runs only after a hit; never raises.
Cost (2-core CPU): 0.5 ms for a float32 finding (one scoped replay); 190 ms of a 300 ms hit
analysis for a float16 256-wide MLP; 360 ms of 820 ms for a tiny float16 GPT-2.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .._finding import Finding
from .._hooks import ReplayHooks
from .._steplog import CompiledSlots, StepView, Top, given
from .._tensors import Path, format_path, get_path, is_bad, own_tensors, tensors
from .graph import GraphOrigin, locate_graph, watched_name
from .inductor import inductor_settings, locate_inductor
from .nodes import blame_nodes, graph_nodes
from .replay import as_it_is, faithful, fresh

__all__ = ["Examined", "examine", "judge", "REDUCED"]

REDUCED = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
# ops that move or cast values and never compute one: left out when the two runs are aligned
_MOVES = frozenset({"_to_copy", "to", "copy_", "clone", "contiguous", "detach", "alias", "lift_fresh",
                    "_unsafe_view", "empty_like", "empty", "zeros_like", "ones_like"})
_logger = logging.getLogger("nanhunt")


def _failed(what: str, exc: Exception) -> None:
    """A replay that failed leaves the verdict out: why, at DEBUG (a bug of the replay's own shows here)."""
    _logger.debug("nanhunt: %s failed (%s: %s)", what, type(exc).__name__, exc)


@dataclass
class Examined:
    verdict: str | None  # None: no replay can say (random numbers only the compiled code draws)
    reference: dict[str, Any]
    origin: GraphOrigin | None = None  # compile-only: where the graph made it


# ---------------------------------------------------------------- replays
class _Scope:
    """Global module hooks during one replay: catches the output of the ``ordinal``-th watched
    call and runs ``mode`` only inside it."""

    def __init__(self, names: dict[nn.Module, str], ordinal: int, mode: TorchDispatchMode | None,
                 inputs: bool = False) -> None:
        self.names = names
        self.ordinal = ordinal
        self.mode = mode
        self.count = 0
        self.depth: list[bool] = []
        self.output: Any = None
        self.done = False
        self.entered = False
        self.hooks: ReplayHooks | None = None
        # the target call itself, to run it alone: module, RNG state at its start, its inputs
        self.module: nn.Module | None = None
        self.rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None
        self.inputs: tuple[Any, Any] | None = None
        self.want_inputs = inputs
        self.own: list[Any] = []  # per-module pre-hooks, with kwargs
        self.thread = 0

    def __enter__(self) -> _Scope:
        self.hooks = ReplayHooks(self.pre, self.post)
        if self.want_inputs:
            # the inputs as the call starts (a global pre-hook gets no kwargs): after it, the call has
            # changed what it was given (appended its keys to a transformers Cache)
            self.thread = threading.get_ident()
            for m in self.names:
                with contextlib.suppress(RuntimeError):  # (a ScriptModule takes none: read after the call)
                    self.own.append(m.register_forward_pre_hook(self.start, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.leave()
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        for h in self.own:
            h.remove()
        self.own.clear()

    def start(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if (module is self.module and self.inputs is None and self.depth and self.depth[-1]
                and threading.get_ident() == self.thread):
            self.inputs = fresh((args, kwargs if isinstance(kwargs, dict) else {}))

    def leave(self) -> None:
        if self.entered:
            self.entered = False
            assert self.mode is not None
            self.mode.__exit__(None, None, None)

    def pre(self, module: nn.Module, args: Any) -> None:
        if module not in self.names or self.done:
            return
        target = self.count == self.ordinal
        self.count += 1
        self.depth.append(target)
        if target:
            cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
            self.module, self.rng = module, (torch.get_rng_state(), cuda)
        if target and self.mode is not None:
            self.mode.__enter__()
            self.entered = True

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any = None) -> None:
        if module not in self.names or self.done or not self.depth:
            return
        if self.depth.pop():
            # (the forward runs on to its end: an exception here would skip the user's own code after
            # the call, a torch.set_default_dtype or a context it undoes, and leave it set)
            self.leave()
            self.done = True
            # as they are now: the caller's code may write them in place after the call (a clamp_)
            self.output = tree_map(as_it_is, output)
            if self.want_inputs and self.inputs is None:  # (its pre-hook did not run)
                self.inputs = fresh((args, kwargs if isinstance(kwargs, dict) else {}))


class _Trace(TorchDispatchMode):
    """Every op's floating outputs (detached), to compare two runs op by op. ``wide``: the float32
    reference, where a cast the forward makes itself down to a reduced float (``x.half()``,
    ``.to(torch.bfloat16)``) keeps float32, as its inputs and parameters do."""

    def __init__(self, wide: bool = False) -> None:
        super().__init__()
        self.wide = wide
        self.ops: list[tuple[str, torch.Tensor]] = []
        # casts down to a narrower float (autocast's, .half()): (ops before it, op, its input)
        self.casts: list[tuple[int, str, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if (self.wide and func is torch.ops.aten._to_copy.default and kwargs
                and str(kwargs.get("dtype")).removeprefix("torch.") in REDUCED):
            kwargs = {**kwargs, "dtype": torch.float32}
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "").split(".")[0]
        if name in _MOVES or getattr(func, "is_view", False):
            src = args[0] if args else None
            if (name in ("_to_copy", "to", "copy_") and isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)
                    and out.is_floating_point() and src.is_floating_point() and out.dtype.itemsize < src.dtype.itemsize):
                src = args[1] if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) else src
                self.casts.append((len(self.ops), str(func), src.detach()))
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                self.ops.append((str(func), t.detach()))
                break
        return out


@contextlib.contextmanager
def _reference_mode(eager: bool, deterministic: bool, float32: bool = False) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if eager and "torch._dynamo" in sys.modules:  # nothing was compiled if dynamo never loaded
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        if float32:
            stack.enter_context(_no_autocast())
        if deterministic:
            was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
            # the eager flag only: torch.use_deterministic_algorithms also sets Inductor's config
            # (and imports all of dynamo to do so), and this replay runs eager
            torch._C._set_deterministic_algorithms(True, warn_only=True)
            stack.callback(torch._C._set_deterministic_algorithms, was, warn_only=warn_only)
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
        yield


_AUTOCAST = torch.amp.autocast_mode.autocast
_ac_lock = threading.Lock()
_ac_depth = 0
_ac_off = threading.local()  # .on: this thread runs a float32 reference


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    """A float32 reference runs without autocast, also where the model enters it itself (``with
    torch.autocast(...)`` or ``@torch.autocast`` inside a forward): the replay had float16 back on
    for that code and judged an overflow of float16 "numerics". While any thread runs one,
    ``autocast.__enter__``/``__exit__`` stand aside on the threads that do; put back after the last."""
    global _ac_depth
    with _ac_lock:
        if _ac_depth == 0:
            _AUTOCAST.__enter__ = _ac_enter  # type: ignore[method-assign]
            _AUTOCAST.__exit__ = _ac_exit  # type: ignore[method-assign]
        _ac_depth += 1
    was = getattr(_ac_off, "on", False)
    _ac_off.on = True
    try:
        yield
    finally:
        _ac_off.on = was
        with _ac_lock:
            _ac_depth -= 1
            if _ac_depth == 0:
                _AUTOCAST.__enter__ = _AC_ENTER  # type: ignore[method-assign]
                _AUTOCAST.__exit__ = _AC_EXIT  # type: ignore[method-assign]


_AC_ENTER = _AUTOCAST.__enter__
_AC_EXIT = _AUTOCAST.__exit__


def _ac_enter(self: Any) -> Any:
    if getattr(_ac_off, "on", False):
        self._nanhunt_off = True  # (its __exit__ stands aside too)
        return None
    return _AC_ENTER(self)


def _ac_exit(self: Any, *exc: Any) -> Any:
    if self.__dict__.pop("_nanhunt_off", False):
        return False
    return _AC_EXIT(self, *exc)


def _as32(x: Any) -> Any:
    return tree_map(lambda t: t.detach().float().requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)


@dataclass
class _Run:
    output: torch.Tensor | None  # the target call's output at the path (None: not reached)
    bad: bool | None  # None: the replay failed
    trace: list[tuple[str, torch.Tensor]]
    casts: list[tuple[int, str, torch.Tensor]] = dataclasses.field(default_factory=list)
    scope: _Scope | None = None  # the target call as the replay saw it (module, RNG, inputs)


def _float32(top: Top) -> tuple[Top, dict[str, Any]]:
    """``top`` as its float32 reference runs it: inputs, parameters and buffers in float32, no
    autocast (the parameters as a state for ``functional_call``: the model itself is untouched)."""
    with torch.no_grad():
        run = copy.copy(top)
        run.autocast = ()
        run.args = _as32(top.args)
        run.kwargs = _as32(top.kwargs or {})
        run.reparam = None  # functional_call's tensors go into the float32 state instead
        return run, {k: _as32(v) for k, v in {**dict(own_tensors(top.module)), **given(top)[0]}.items()}


def _run(top: Top, names: dict[nn.Module, str], ordinal: int, path: Path, *, compiled: Any = None,
         eager: bool = False, float32: bool = False, trace: bool = False, keep: Sequence[torch.Tensor] = (),
         inputs: bool = False) -> _Run:
    """One replay of ``top``; what the ``ordinal``-th watched call put at output ``path`` (``inputs``:
    and what it was given, to run it alone)."""
    saved = [t.clone() for t in keep]
    mode = _Trace() if trace else None
    scope = _Scope(names, ordinal, mode, inputs)
    run = top
    try:
        if float32:
            run, state = _float32(top)
        with (_reference_mode(eager or float32, deterministic=eager or float32, float32=float32),
              faithful(run, compiled=compiled is not None)):
            if compiled is not None:
                if ordinal and keep:  # an inner module's value: what the graph's own checks see of this run
                    with torch.no_grad():
                        for t in keep:
                            t.zero_()
                out = compiled(*run.args, **(run.kwargs or {}))
                got = dict(tensors(out)).get(tuple(path)) if ordinal == 0 else None
                if got is None:
                    # an inner value the model absorbs before its output (nan_to_num) shows in the checks
                    bad = any(is_bad(t) for _, t in tensors(out)) or any(is_bad(t) for t in keep if ordinal)
                    return _Run(None, bad, [])
                return _Run(got.detach(), is_bad(got), [])
            try:
                with scope:
                    if float32:
                        torch.func.functional_call(top.module, state, run.args, run.kwargs or {}, strict=False)
                    else:
                        top.module(*run.args, **(run.kwargs or {}))
            except Exception:
                if not scope.done:
                    raise  # (past the target call, the rest of the forward cannot change what was seen)
        if not scope.done:
            return _Run(None, None, [])
        got = dict(tensors(scope.output)).get(tuple(path))
        got = got.detach() if got is not None else None  # values only (a float() of it would warn)
        return _Run(got, is_bad(got) if got is not None else None, mode.ops if mode is not None else [],
                    mode.casts if mode is not None else [], scope)
    except Exception as exc:
        _failed(f"a verdict's replay of {type(top.module).__name__}", exc)
        return _Run(None, None, [])
    finally:
        with torch.no_grad():
            for t, v in zip(keep, saved):
                t.copy_(v)


def _alone(top: Top, scope: _Scope, path: Path, *, float32: bool) -> _Run:
    """The target call alone, on the inputs it got in a replay, from the RNG state it started at,
    traced op by op: as it failed (the top's autocast), or in float32 (float32 copies of its own
    parameters and inputs, autocast off). Only that module's parameters are copied."""
    module, rng, inputs = scope.module, scope.rng, scope.inputs
    if module is None or rng is None or inputs is None:
        return _Run(None, None, [])
    mode = _Trace(wide=float32)
    run = copy.copy(top)
    run.module, run.rng, run.cuda_rng = module, rng[0], rng[1]
    prefix = next((n for n, m in top.module.named_modules() if m is module), "")
    was_given = given(top, prefix)[0]  # functional_call's tensors, for the module alone
    own = {**dict(own_tensors(module)), **was_given}
    run.reparam = None
    # its mode when called: its own flag, unless the whole model was switched since (then the call's,
    # or the other one for a module that was not in the model's mode: a frozen BatchNorm)
    if top.module.training == top.training:
        run.training = module.training
    else:
        run.training = (not top.training) if any(m is module for m in top.odd_modes) else top.training
    run.odd_modes = ()
    try:
        run.args, run.kwargs = fresh(inputs)  # (each run its own copy: the call changes what it is given)
        with torch.no_grad():
            if float32:
                run.autocast = ()
                run.args, run.kwargs = _as32(run.args), _as32(run.kwargs)
                state = {k: _as32(v) for k, v in own.items()}
            with _reference_mode(float32, deterministic=float32, float32=float32), faithful(run), mode:
                if float32:
                    out = torch.func.functional_call(module, state, run.args, run.kwargs or {}, strict=False)
                elif was_given:
                    out = torch.func.functional_call(module, own, run.args, run.kwargs or {}, strict=False)
                else:
                    out = module(*run.args, **(run.kwargs or {}))
        got = dict(tensors(out)).get(tuple(path))
        got = got.detach() if got is not None else None
        return _Run(got, is_bad(got) if got is not None else None, mode.ops, mode.casts)
    except Exception as exc:
        _failed(f"{prefix or type(module).__name__} run alone ({'float32' if float32 else 'as it failed'})", exc)
        return _Run(None, None, [])


class _Input:
    """Global module hooks during one replay: the ``ordinal``-th watched call's input at ``path``
    (``(0, i)`` positional, ``(1, key)`` keyword), whose gradient a backward finding reports."""

    def __init__(self, names: dict[nn.Module, str], ordinal: int, path: Path) -> None:
        self.names, self.ordinal, self.path = names, ordinal, tuple(path)
        self.count = 0
        self.tensor: torch.Tensor | None = None
        self.hooks = ReplayHooks(self.pre, lambda *a: None)

    def pre(self, module: nn.Module, args: Any) -> None:
        if module not in self.names:
            return
        if self.count == self.ordinal:
            try:
                t = get_path((args, {}), self.path) if self.path[:1] == (0,) else None
            except Exception:
                t = None
            self.tensor = t if isinstance(t, torch.Tensor) and t.requires_grad else None
        self.count += 1


def _run_backward(top: Top, names: dict[nn.Module, str], ordinal: int, path: Path,
                  grads: list[torch.Tensor | None], *, float32: bool = False,
                  mode: TorchDispatchMode | None = None) -> _Run:
    """One forward + ``autograd.grad`` replay of ``top`` from the gradients that arrived at its
    outputs; the gradient w.r.t. the ``ordinal``-th watched call's input ``path``. ``mode``: a
    dispatch mode on during the backward only."""
    run = top
    scope = _Input(names, ordinal, path)
    try:
        if float32:
            run, state = _float32(top)
            with torch.no_grad():
                grads = [_as32(g) for g in grads]
        with _reference_mode(float32, deterministic=float32, float32=float32), faithful(run), torch.enable_grad():
            try:
                if float32:
                    out = torch.func.functional_call(top.module, state, run.args, run.kwargs or {}, strict=False)
                else:
                    out = top.module(*run.args, **(run.kwargs or {}))
            finally:
                scope.hooks.remove()
            x = scope.tensor
            outs = [t for _, t in tensors(out) if t.requires_grad]
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            if x is None or not pairs:
                return _Run(None, None, [])
            with mode if mode is not None else contextlib.nullcontext():
                (gx,) = torch.autograd.grad([o for o, _ in pairs], [x], [g for _, g in pairs], allow_unused=True)
        if gx is None:
            return _Run(None, False, [])
        return _Run(gx, is_bad(gx), [])
    except Exception as exc:
        _failed(f"a verdict's backward replay of {type(top.module).__name__}", exc)
        return _Run(None, None, [])
    finally:
        scope.hooks.remove()


# ---------------------------------------------------------------- verdicts
def _where_device(top: Top) -> dict[str, Any]:
    dev = next((t.device for _, t in tensors(top.args)), None)
    if dev is None:
        dev = next((p.device for p in top.module.parameters()), torch.device("cpu"))
    out: dict[str, Any] = {"device": str(dev), "host": socket.gethostname()}
    if dev.type == "cuda":
        try:
            i = dev.index if dev.index is not None else torch.cuda.current_device()
            out["device"] = f"cuda:{i}"
            out["uuid"] = str(torch.cuda.get_device_properties(i).uuid)
            out["name"] = torch.cuda.get_device_name(i)
        except Exception:
            pass
    return out


def _low_dtype(top: Top, f: Finding, op_dtype: str | None = None) -> torch.dtype | None:
    """The reduced dtype the failing run computed in: the finding's, autocast's around the call, or
    that of the op that made the value (``op_dtype``: autocast entered inside the forward, a float16
    op whose result the module hands on as float32)."""
    dtype = f.dtype or next((str(p.dtype).removeprefix("torch.") for p in top.module.parameters()
                             if p.is_floating_point()), "")  # no element known: the model's own dtype
    for d in (dtype, op_dtype):
        if d in REDUCED:
            return getattr(torch, str(d))
    for _dev, enabled, dtype in top.autocast:
        if enabled and str(dtype).removeprefix("torch.") in REDUCED:
            return dtype
    return None


def _value_at(t: torch.Tensor, index: tuple[int, ...] | None, limit: float | None = None) -> tuple[float, tuple[int, ...]]:
    """``t`` at ``index`` when that element is the one that matters, else the largest magnitude."""
    if index is not None and len(index) == t.dim() and all(0 <= i < s for i, s in zip(index, t.shape)):
        v = float(t[index])
        if limit is None or not math.isfinite(v) or abs(v) >= limit:
            return v, tuple(index)
    flat = t.detach().reshape(-1).float()
    fin = torch.where(torch.isfinite(flat), flat.abs(), torch.zeros_like(flat))
    i = int(fin.argmax()) if flat.numel() else 0
    idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), t.shape)) if t.dim() else ()
    return float(t[idx]), idx


def _rounds_to_inf(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds past ``dtype``'s largest value (half a unit in the last
    place above it: 65520 in float16); a float32 65504.04 rounds to 65504, which is finite."""
    fi = torch.finfo(dtype)
    return float(fi.max) + float(fi.eps) * 2.0 ** math.floor(math.log2(fi.max)) / 2


def _overflow(fail: list[tuple[str, torch.Tensor]], ref: list[tuple[str, torch.Tensor]], low: torch.dtype,
              f: Finding, casts: Sequence[tuple[int, str, torch.Tensor]] = ()) -> dict[str, Any] | None:
    """The first op whose float32 value passes the largest value of the dtype it ran in when the run
    failed (op by op when the two runs line up; else against the failing dtype throughout). A cast
    down to that dtype (autocast's copy of a weight) counts as the op when its input did."""
    limit, past = float(torch.finfo(low).max), _rounds_to_inf(low)
    with torch.no_grad():
        over = [c for c in casts if bool((c[2].abs() >= past).any())]
    got = _computed_overflow(fail, ref, low, f, before=over[0][0] if over else None)
    if got is None and over:
        _, op, src = over[0]
        index = f.index if tuple(src.shape) == tuple(f.shape) else None
        value, _ = _value_at(src, index, past)
        got = {"dtype": str(src.dtype).removeprefix("torch."), "op": op, "value": value, "limit": limit,
               "failing_dtype": str(low).removeprefix("torch."), "failing": math.copysign(math.inf, value)}
    return got


def _underflow(fail: list[tuple[str, torch.Tensor]], ref: list[tuple[str, torch.Tensor]], low: torch.dtype,
               f: Finding) -> dict[str, Any] | None:
    """No op passed the range: the first op (the two runs lined up) whose float32 value is below
    the dtype's smallest normal number where the failing run holds 0 (a square of 1e-4 in float16:
    0, then log(0) = -inf): first among the ops of the reported tensor's shape, at its element (on
    its way), else any. Its float32 value there, the smallest normal (``smallest``), ``underflow``."""
    if len(fail) != len(ref) or not all(a[0] == b[0] for a, b in zip(fail, ref)):
        return None
    if f.op is not None and f.op.startswith("aten.") and f.op.split(".")[1].rstrip("_") not in _FROM_ZERO:
        return None  # (sqrt of a negative variance: no 0 makes that op's NaN, so no 0 is the cause)
    tiny = float(torch.finfo(low).tiny)
    shape, index = tuple(f.shape or ()), tuple(f.index) if f.index is not None else None
    anywhere: tuple[str, torch.Tensor, tuple[int, ...]] | None = None
    with torch.no_grad():
        for (op, t), (_, u) in zip(ref, fail):
            if u.dtype != low or tuple(u.shape) != tuple(t.shape) or not t.is_floating_point():
                continue
            # (a difference of values that round to the same number, 1 - sigmoid(z) in bfloat16: 0 at any size)
            cancelled = op.startswith("aten.") and op.split(".")[1] in _CANCELS
            lost = (u == 0) & (t != 0) & (True if cancelled else t.abs() < tiny)
            if index is not None and tuple(t.shape) == shape and len(index) == t.dim():
                if bool(lost[index]):
                    return _underflow_ref(op, float(t[index]), tiny, low)
            elif anywhere is None and bool(lost.any()):
                anywhere = (op, t, tuple(int(i) for i in lost.nonzero()[0]))
            if u.is_floating_point() and not bool(torch.isfinite(u).all()):
                break  # (the value was born here: an op after it cannot have caused it)
    if anywhere is None:
        return None
    op, t, at = anywhere
    return _underflow_ref(op, float(t[at]), tiny, low)


# ops that make a NaN/Inf of a 0 (log(0), x/0, 0/0, 0 ** -1, rsqrt(0)): only their values can be born of an underflow
_FROM_ZERO = frozenset({"log", "log2", "log10", "div", "true_divide", "floor_divide", "reciprocal", "rsqrt", "pow",
                        "float_power", "lgamma", "digamma", "polygamma", "remainder", "fmod", "xlogy"})


# subtractions: their 0 is a cancellation (both sides rounded to one value), at any size of the float32 difference
_CANCELS = frozenset({"sub", "rsub"})


def _underflow_ref(op: str, value: float, tiny: float, low: torch.dtype) -> dict[str, Any]:
    got = {"dtype": "float32", "op": op, "value": value, "smallest": tiny,
           "failing_dtype": str(low).removeprefix("torch."), "failing": 0.0, "underflow": True}
    if abs(value) >= tiny:  # (a cancellation, see `_CANCELS`)
        got["cancelled"] = True
    return got


def _computed_overflow(fail: list[tuple[str, torch.Tensor]], ref: list[tuple[str, torch.Tensor]], low: torch.dtype,
                       f: Finding, before: int | None) -> dict[str, Any] | None:
    if not ref:
        return None
    aligned = len(fail) == len(ref) and all(a[0] == b[0] for a, b in zip(fail, ref))
    with torch.no_grad():
        amax = torch.stack([t.abs().amax().float() for _, t in ref]).tolist()
    for i, (op, t) in enumerate(ref):
        if before is not None and i >= before:
            return None  # a cast overflowed first
        dt = fail[i][1].dtype if aligned else low
        if not dt.is_floating_point or dt.itemsize >= 4:
            continue  # computed in float32 (or wider) when it failed: it cannot have overflowed there
        limit, past = float(torch.finfo(dt).max), _rounds_to_inf(dt)
        if not amax[i] >= past:
            continue  # (rounds to the largest value at most: finite when it failed)
        if aligned and tuple(fail[i][1].shape) == tuple(t.shape) and bool(torch.isfinite(fail[i][1]).all()):
            continue  # finite when it failed: a value of the dtype's own (a finfo(dtype).min mask), no overflow
        index = f.index if tuple(t.shape) == tuple(f.shape) else None
        if index is None and aligned and tuple(fail[i][1].shape) == tuple(t.shape):
            bad = (~torch.isfinite(fail[i][1])).nonzero()  # (the op's own first non-finite element: the hint's)
            index = tuple(int(v) for v in bad[0]) if len(bad) else None
        value, at = _value_at(t, index, past)
        got: dict[str, Any] = {"dtype": "float32", "op": op, "value": value, "limit": limit,
                               "failing_dtype": str(dt).removeprefix("torch.")}
        if aligned and tuple(fail[i][1].shape) == tuple(t.shape):
            got["failing"] = float(fail[i][1][at])
        return got
    return None


def _agreement(first: bool | None, again: Callable[[], bool | None], top: Top) -> Examined | Literal[True] | None:
    """Do replays of the failing configuration agree? ``first``: the first one's answer (None: it
    failed to run), ``again()`` runs one more (a third when neither reproduced it). True when every
    replay that ran reproduced it; else the verdict (``transient``, ``nondeterministic``), or None
    when no replay ran."""
    runs = [first, again()]
    if not any(runs):
        runs.append(again())
    seen = [r for r in runs if r is not None]
    if not seen:
        return None
    if not any(seen):
        return Examined("transient", {"replays": len(seen), **_where_device(top)})
    if not all(seen):
        return Examined("nondeterministic", {"replays": len(seen), "reproduced": sum(seen), **_where_device(top)})
    return True


def examine(top: Top, names: dict[nn.Module, str], f: Finding, ordinal: int, path: Path, *,
            compiled: Any = None, prefix: str = "", keep: Sequence[torch.Tensor] = (),
            op_dtype: str | None = None, again: bool | None = None) -> Examined | None:
    """The verdict on a forward finding made in ``top`` at the ``ordinal``-th call's output ``path``.

    ``compiled``: the ``torch.compile`` wrapper that ran ``top`` (the failing configuration), else
    ``None``. ``keep``: tensors a compiled graph writes into (nanhunt's own slots), put back after.
    ``again``: an eager replay's answer already had (`judge`): the agreement's second replay, not run again.
    """
    try:
        return _examine(top, names, f, ordinal, path, compiled, prefix, keep, op_dtype, again)
    except Exception as exc:
        _failed("the verdict's analysis", exc)
        return None


def _examine(top: Top, names: dict[nn.Module, str], f: Finding, ordinal: int, path: Path,
             compiled: Any, prefix: str, keep: Sequence[torch.Tensor], op_dtype: str | None = None,
             again: bool | None = None) -> Examined | None:
    had = [again] if again is not None and compiled is None else []  # (eager: the failing configuration)

    def failing() -> bool | None:
        if had:
            return had.pop()
        return _run(top, names, ordinal, path, compiled=compiled, keep=keep).bad

    agreed = _agreement(f.reproducible if compiled is None else failing(), failing, top)
    if agreed is not True:
        return agreed
    if compiled is not None:
        eager = _run(top, names, ordinal, path, eager=True)
        if eager.bad is False:
            settings = inductor_settings(compiled)
            seen: dict[str, Any] = {}
            if settings is not None:  # fused kernels dispatch nothing: a capturing re-compile
                origin = locate_inductor(compiled, settings, top, prefix, path if ordinal == 0 else None, keep, seen)
            else:
                origin = locate_graph(compiled, top, prefix, path if ordinal == 0 else None, keep)
            if "random" in seen:
                return _drawn_by_inductor(f, origin, seen)
            ref: dict[str, Any] = {"config": "eager"}
            if f.dtype:
                ref["dtype"] = f.dtype
            if origin is not None:
                ref.update(op=origin.op, node=origin.node, dtype=origin.dtype or f.dtype)
            if eager.output is not None and f.index is not None and tuple(eager.output.shape) == tuple(f.shape):
                ref["value"] = float(eager.output[f.index])
                ref["failing"] = f.value
            return Examined("compiler", ref, origin)
    low = _low_dtype(top, f, op_dtype)
    if low is None:  # it failed in float32 (or wider) eager: the reference is the failing run itself
        return Examined("numerics", _numerics(f.dtype or "float32", f, f.value))
    # the failing call alone, on the inputs a replay gives it, as it failed and in float32: the
    # reference never holds more than that module's parameters in float32 (a big model's would not fit)
    cap = _run(top, names, ordinal, path, inputs=True)
    if cap.scope is None:
        return None
    fail = _alone(top, cap.scope, path, float32=False)
    ref32 = _alone(top, cap.scope, path, float32=True)
    if ref32.bad is None:
        return None
    if ref32.bad:
        value = f.value
        if ref32.output is not None and f.index is not None and tuple(ref32.output.shape) == tuple(f.shape):
            value = float(ref32.output[f.index])
        return Examined("numerics", _numerics("float32", f, value))
    got = _overflow(fail.trace, ref32.trace, low, f, fail.casts)
    if got is None:
        got = _underflow(fail.trace, ref32.trace, low, f)
    if got is None:
        # no op passed the dtype's range: the value is the reported element's, named by ``tensor``
        # (``op`` made the first non-finite value; its own float32 value is not this one)
        got = {"dtype": "float32", "op": f.op, "tensor": f.tensor, "limit": float(torch.finfo(low).max),
               "failing_dtype": str(low).removeprefix("torch.")}
        if ref32.output is not None:
            got["value"], _ = _value_at(ref32.output, f.index)
    got.setdefault("failing", f.value)
    return Examined("precision", got)


def _drawn_by_inductor(f: Finding, origin: GraphOrigin | None, seen: dict[str, Any]) -> Examined:
    """Inductor drew the graph's random numbers with its own generator (``fallback_random`` off): the
    eager replay drew others (another dropout mask), so its being finite says nothing. The graph
    run node by node on the numbers the compiled code drew made it: the math ("numerics"); a compiled
    prefix that makes what that run has finite: the compiler; else no verdict."""
    ref: dict[str, Any] = {"config": "eager", "random": seen["random"]}
    if origin is None or not seen.get("drawn"):  # (a graph run on numbers of its own draw found some other value)
        return Examined(None, ref)
    ref.update(op=origin.op, node=origin.node, dtype=origin.dtype or f.dtype)
    if origin.value is not None:
        ref["value"] = origin.value
    if seen.get("interpreted"):
        return Examined("numerics", {**ref, "config": "eager graph on the compiled run's random numbers"}, origin)
    return Examined("compiler", ref, origin)


def _numerics(dtype: str, f: Finding, value: float | None) -> dict[str, Any]:
    """The reference of a "numerics" verdict: ``value`` is the reported tensor's element (named by
    ``tensor``) in the reference run, not the value of ``op``, which made the first non-finite value."""
    return {"dtype": dtype, "op": f.op, "tensor": f.tensor, "value": value}


def examine_backward(top: Top, names: dict[nn.Module, str], f: Finding, ordinal: int, path: Path,
                     grads: list[torch.Tensor | None]) -> Examined | None:
    """The verdict on a backward finding: the gradient w.r.t. input ``path`` of the ``ordinal``-th
    call, replayed from ``grads`` (those that arrived at ``top``'s outputs). Eager only."""
    try:
        agreed = _agreement(f.reproducible, lambda: _run_backward(top, names, ordinal, path, grads).bad, top)
        if agreed is not True:
            return agreed
        low = _low_dtype(top, f)
        if low is None:
            return Examined("numerics", _numerics(f.dtype or "float32", f, f.value))
        ref = _run_backward(top, names, ordinal, path, grads, float32=True)
        if ref.bad is None:
            return None
        value: float | None = f.value
        if ref.output is not None and f.index is not None and tuple(ref.output.shape) == tuple(f.shape):
            value = float(ref.output[f.index])
        if ref.bad:
            return Examined("numerics", _numerics("float32", f, value))
        got: dict[str, Any] = {"dtype": "float32", "op": f.op, "value": value, "limit": float(torch.finfo(low).max),
                               "failing_dtype": str(low).removeprefix("torch."), "failing": f.value}
        return Examined("precision", got)
    except Exception as exc:
        _failed("the verdict's analysis (backward)", exc)
        return None


def examine_node(top: Top, f: Finding, nth: int, slot: int, grads: list[torch.Tensor | None],
                 node: str | None = None) -> Examined | None:
    """The verdict on a gradient that an autograd node made from finite ones in float16/bfloat16
    (a weight's gradient inside a module: no module input to replay it at): the call's forward and
    backward again in float32, autocast off; the same node is the ``nth`` of its name (``node``,
    default ``f.op``) to run."""
    low = _low_dtype(top, f)
    node = node or f.op
    if low is None or node is None:
        return None
    same: list[torch.Tensor | None] = []
    handles: list[Any] = []

    def keep(gi: Any, go: Any) -> None:
        same.append(gi[slot].detach() if slot < len(gi) and isinstance(gi[slot], torch.Tensor) else None)

    try:
        run, state = _float32(top)
        with torch.no_grad():
            grads = [_as32(g) for g in grads]
        with _reference_mode(True, deterministic=True, float32=True), faithful(run), torch.enable_grad():
            out = torch.func.functional_call(top.module, state, run.args, run.kwargs or {}, strict=False)
            pairs = [(o, g) for o, g in zip([t for _, t in tensors(out) if t.requires_grad], grads) if g is not None]
            leaves = [t for t in state.values() if isinstance(t, torch.Tensor) and t.requires_grad]
            leaves += [t for _, t in tensors((run.args, run.kwargs)) if t.requires_grad and t.is_leaf]
            if not pairs or not leaves:
                return None
            nodes = graph_nodes([o.grad_fn for o, _ in pairs])
            handles = [fn.register_hook(keep) for fn in nodes if fn.name() == node]

            def backward() -> None:
                torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)

            bad = blame_nodes(nodes, backward) is not None
        ref = same[nth] if nth < len(same) else None
        value: float | None = f.value
        if ref is not None and f.index is not None and tuple(ref.shape) == tuple(f.shape):
            value = float(ref[f.index])
        if bad:
            return Examined("numerics", _numerics("float32", f, value))
        return Examined("precision", {"dtype": "float32", "op": f.op, "value": value,
                                      "limit": float(torch.finfo(low).max),
                                      "failing_dtype": str(low).removeprefix("torch."), "failing": f.value})
    except Exception as exc:
        _failed(f"the float32 replay of {node}", exc)
        return None
    finally:
        for h in handles:
            h.remove()


def _random_hint(src: str) -> str:
    at = f" (at {src})" if src else ""
    return (f"Inductor drew this graph's random numbers{at} with its own generator "
            "(torch._inductor.config.fallback_random is False), so no eager replay draws the same ones (another "
            "dropout mask) and no op or verdict can be given: set torch._inductor.config.fallback_random = True "
            "before compiling (random ops then draw as eager does) and rerun to have the op and line.")


def _first_bad_slot(view: StepView) -> tuple[str, str, Path] | None:
    """The first module (in the compiled graph's order) whose output the failing run's in-graph
    checks saw non-finite."""
    _, vbad = view.log.bad_flags()
    for (_, entry), flags in zip(view.log.vectors, vbad):
        if isinstance(entry, CompiledSlots) and any(flags):
            return entry.first(flags)
    return None


def judge(view: StepView, f: Finding, where: tuple[str, int, int, Path] | None, op_dtype: str | None = None,
          again: bool | None = None) -> Finding:
    """``f`` with its verdict and reference; a compile-only value also gets the graph's module,
    op, line and element. ``where``: (phase, top index, call ordinal, output path) of the finding;
    ``op_dtype``: the dtype the op that made it computed in, where the op trace saw it; ``again``:
    whether an eager replay of the failing call made since the finding's own (the op trace's)
    came out non-finite there (None: none did)."""
    if where is None or not view.replay or f.cause in ("input", "parameter"):
        return f  # fed a non-finite value, or poisoned weights: any replay reproduces it, which says nothing of the math
    phase, top_i, ordinal, path = where
    top = view.log.tops[top_i]
    if phase == "backward":
        if top.compiled is not None and f.verdict is not None:
            return f  # a gradient only the compiled backward makes has its verdict already (analyze._compiled_backward)
        grads = [view.log.tensors[k].grad for k in top.out_keys]
        e = examine_backward(top, view.names, f, ordinal, path, grads)
        return f if e is None else dataclasses.replace(f, verdict=e.verdict, reference=e.reference)
    e = examine(top, view.names, f, ordinal, path, compiled=top.compiled,
                prefix=view.names.get(top.module, ""), keep=view.scratch, op_dtype=op_dtype, again=again)
    if e is None:
        return f
    f = dataclasses.replace(f, verdict=e.verdict, reference=e.reference)
    if e.verdict is None and "random" in e.reference:
        f = dataclasses.replace(f, hint=_random_hint(e.reference["random"]))
    o = e.origin
    if o is None:
        # no op seen (Inductor's fused kernels; no replay reproduced it; random numbers only the
        # compiled code draws): the module the failing run's own in-graph checks name
        slot = _first_bad_slot(view) if e.verdict in ("compiler", None) or (f.op is None and e.verdict in (
            "transient", "nondeterministic")) else None
        if slot is not None:
            sname, stype, spath = slot
            compiler = e.verdict == "compiler"
            tensor = format_path("output", spath)
            if (sname, tensor) != (f.module, f.tensor):
                # the checks flag that output, never keep it: the element, counts, shape and dtype (and
                # the reference's values) were the root's output's, which the finding no longer names
                f = dataclasses.replace(f, index=None, value=None, counts={}, shape=(), dtype="", reference={
                    k: v for k, v in f.reference.items() if k not in ("value", "failing")})
            f = dataclasses.replace(f, module=sname, module_type=stype, tensor=tensor,
                                    reproducible=True if compiler else f.reproducible,
                                    cause="created" if compiler else f.cause)
        return f
    name = watched_name(o, view.names)
    module, mtype = (name, o.module_type) if name is not None else (f.module, f.module_type)
    return dataclasses.replace(
        f, module=module, module_type=mtype or f.module_type, tensor="output" if module != f.module else f.tensor,
        op=o.op, source=o.source, chain=tuple(o.chain), cause="created", reproducible=True,
        index=o.index, value=o.value, counts=dict(o.counts), shape=tuple(o.shape), dtype=o.dtype or f.dtype,
    )
