"""Code outside every watched module call: loss and metric code, the loop's own tensor code.

A `TorchFunctionMode` that is on the mode stack only while no watched root call runs: the hunt
turns it on when a root call returns and off when the next one starts, at the step's end (the
optimizer's step pre-hook, before the single sync) and while nanhunt's own code runs. Each torch
call made there costs one Python call: its floating outputs are probed into the step's log the way
module outputs are (one device-side sum, no host read: `Out` entries), and the call is recorded
(function, arguments by reference, outputs, the user's line) so that, after a hit, `_locate.outside`
can replay that code op by op. ``Tensor.backward`` / ``torch.autograd.backward`` run with the mode
stashed (the autograd engine captures the mode stack when a backward starts, so the backward never
pays for it); their arguments are recorded as the seeds of a replay of the outside code's backward.

Measured (benchmarks/overhead.py loops): two intercepts per step (the loss function and
``backward``), ~15-20 us each on a CPU core. The mode stays off after ``optimizer.step()`` until
the next root call: ``zero_grad``'s ``p.grad`` reads and writes go through ``__torch_function__``
(one call per parameter: +20% on the 24-block MLP), so code there is not watched.

Several hunts share one switch: at most one mode is on the stack, recording for every hunt whose
root call has returned (each into its own log), and none while any watched root call runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import types
import weakref
from threading import get_ident
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as module_mod
from torch.overrides import TorchFunctionMode, handle_torch_function
from torch.utils._device import DeviceContext as _DeviceContext  # set_default_device's: the stack's bottom

from .._hooks import REPLAYING, in_transform
from .._hooks import tick as _tick
from .._steplog import Out, OutRec, StepLog
from .._tensors import is_checked, probe, storage_of

if TYPE_CHECKING:
    from .hunt import Hunt

__all__ = ["Outside", "user_line", "is_lib"]

_BACKWARD = frozenset({torch.Tensor.backward, torch.autograd.backward})
_REGISTER_HOOK = torch.Tensor.register_hook
_PASS = frozenset({torch.autograd.grad})


def _profiler_ops() -> frozenset[Any]:
    """``record_function``'s ops (``Optimizer.step()`` enters one before its hooks run, while the
    recorder is still on): the profiler's bookkeeping, never the user's computation."""
    out: set[Any] = set()
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        try:
            packet = getattr(torch.ops.profiler, name)
            out.update([packet, *(getattr(packet, o) for o in packet.overloads())])
        except (AttributeError, RuntimeError):  # (not in this build of torch)
            continue
    return frozenset(out)


_UNRECORDED = _profiler_ops()
_OP_TYPES = frozenset(type(f) for f in _UNRECORDED)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_NANHUNT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_LOADER_DIR = os.path.join(_TORCH_DIR, "utils", "data") + os.sep
_lib: dict[str, bool] = {}


_is_autocast = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype


def _autocast() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocasts on at a call (loss code inside ``torch.autocast``): what its replay runs under."""
    on: tuple[tuple[str, torch.dtype], ...] = ()
    if _is_autocast("cpu"):
        on = (("cpu", _autocast_dtype("cpu")),)
    if _is_autocast("cuda"):
        on += (("cuda", _autocast_dtype("cuda")),)
    return on


_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass
_tracing_state = torch._C._get_tracing_state  # None unless torch.jit.trace is recording


def _carried(name: str, args: Any) -> torch.Tensor | None:
    """An in-place arithmetic write (``add_``, ``mul_``: ``running += loss``): whether its target
    held no NaN and no +inf before it (a -inf mask may; a NaN the write makes of it is born here), on
    the device (no host read); None for any other call."""
    if not (name.endswith("_") and not name.startswith("_")) or not args:
        return None
    t = args[0]
    if not isinstance(t, torch.Tensor) or not is_checked(t) or not t.numel() or t.is_meta:
        return None
    with _NO_SUBCLASS():
        s = probe(t)  # nan with a NaN (or both infinities), +inf with +inf, -inf with -inf alone
        return ~(torch.isnan(s) | (s == math.inf))


def is_lib(filename: str) -> bool:
    k = _lib.get(filename)
    if k is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        k = (path.startswith(_TORCH_DIR) or path.startswith(_NANHUNT_DIR) or filename.startswith("<frozen")
             or (path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path[len(_STDLIB_DIR):]))
        _lib[filename] = k
    return k


_own: dict[str, bool] = {}


def _own_code(filename: str) -> bool:
    k = _own.get(filename)
    if k is None:
        k = _own[filename] = os.path.abspath(filename).startswith(_NANHUNT_DIR)
    return k


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line (the first frame outside
    torch, nanhunt and the stdlib: the ``opt.step()`` or ``model(x)`` that ended the step)."""
    f: Any = sys._getframe(2)  # the caller of warnings.warn's caller
    level = 2
    while f is not None and is_lib(f.f_code.co_filename):
        f = f.f_back
        level += 1
    return level if f is not None else 2


def user_line(depth: int = 2) -> tuple[str | None, str]:
    """``file:line`` and function name of the first frame outside torch, nanhunt and the stdlib."""
    f = _user_frame(depth + 1)
    if f is None:
        return None, ""
    code = f.f_code
    return f"{code.co_filename}:{f.f_lineno}", getattr(code, "co_qualname", code.co_name)


def _plain_call(func: Any, args: Any, kwargs: Any) -> Any:
    return func(*args, **kwargs)


_HOOK_PATH = frozenset(getattr(f, "__code__", None) for f in (torch.Tensor.register_hook, handle_torch_function))


def _hooked_by_user() -> bool:
    """Was the ``register_hook`` being intercepted called by code outside torch (the user's, not a
    module's full backward hook, which torch registers on each of its outputs)?"""
    f: Any = sys._getframe(2)
    while f is not None and f.f_code in _HOOK_PATH:
        f = f.f_back
    return f is not None and not is_lib(f.f_code.co_filename)


def _user_frame(depth: int) -> Any:
    f: Any = sys._getframe(depth)
    while f is not None:
        if not is_lib(f.f_code.co_filename):
            return f
        f = f.f_back
    return None


_loader: dict[str, bool] = {}


def _caller(depth: int) -> Any:
    """`_user_frame`'s frame, or False when a ``DataLoader``'s own code (its fetch and collate: the
    ``torch.stack`` of the next batch) lies on the way to it: the data pipeline is not the user's
    outside code. Run between two root calls when no ``step()`` ends them (a validation or
    inference loop), it was recorded into the step before it: a NaN of the next batch was that
    step's, with its rows. The batch is judged where it enters the model, as its input."""
    f: Any = sys._getframe(depth)
    while f is not None:
        name = f.f_code.co_filename
        if not is_lib(name):
            return f
        k = _loader.get(name)
        if k is None:
            k = _loader[name] = os.path.abspath(name).startswith(_LOADER_DIR)
        if k:
            return False
        f = f.f_back
    return None


_CALL = compile("def call(f, a, k): return f(*a, **k)", "<nanhunt>", "exec").co_consts[0]
_calls: dict[tuple[str, int, str], Any] = {}


def _from_user_line(frame: Any) -> Any:
    """A ``call(func, args, kwargs)`` whose frame says the user's file, line and function: a
    warning the call raises (torch's C++ warnings take the innermost Python frame; a Python
    ``warn(stacklevel=2)`` its caller's) points at the user's line, filtered and registered in
    the user's module, not at this recorder."""
    code = frame.f_code
    name = code.co_name if code.co_name.isidentifier() else "call"
    key = (code.co_filename, frame.f_lineno or 1, name)
    fn = _calls.get(key)
    if fn is None:
        if len(_calls) >= 4096:
            _calls.clear()
        c = _CALL.replace(co_filename=key[0], co_firstlineno=key[1], co_name=name,
                          **({"co_qualname": getattr(code, "co_qualname", name)} if hasattr(code, "co_qualname") else {}))
        fn = _calls[key] = types.FunctionType(c, frame.f_globals, name)
    return fn


class _Apply:
    """``cls.apply`` as one recorded outside call: a custom ``autograd.Function`` applied in loss
    code is replayed as itself (its own backward node), not as the ops of its forward. Called with
    the arguments torch's ``Function.apply`` hands its base (defaults bound), it runs the base's."""

    __slots__ = ("cls", "__name__")

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.__name__ = f"{cls.__name__}.apply"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _BASE_APPLY.__get__(None, self.cls)(*args, **kwargs)


# ``Function.apply`` (Python) ends in ``super().apply(...)``, looked up on the class below it,
# then torch._C._FunctionBase's. The recorder's route goes on that class, below the name user code
# binds: ``grad_reverse = GradReverse.apply`` at import time (bound to torch's Function.apply
# before any watch) is routed as a call of ``GradReverse.apply`` is
_BELOW: type = torch.autograd.function._SingleLevelFunction
_BASE_APPLY: Any = torch._C._FunctionBase.__dict__["apply"]  # (a classmethod descriptor)


def _recorded_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``Function.apply``'s base while the outside recorder is on the stack (set by `_Switch` only
    then; other threads, with no mode of theirs, go straight through)."""
    if _SWITCH.on is not None and torch._C._is_torch_function_mode_enabled():
        return torch.overrides.handle_torch_function(_Apply(cls), (), *args, **kwargs)
    return _BASE_APPLY.__get__(None, cls)(*args, **kwargs)


_RECORDED_APPLY: Any = classmethod(_recorded_apply)


def _route_apply(on: bool) -> None:
    """Route custom autograd Functions through the recorder while it is on (and only then: nothing
    of it is left once the mode is off the stack, nor inside any watched call); see the fast-path
    modules too (`_FastPath`)."""
    if on:
        if "apply" not in _BELOW.__dict__:
            _BELOW.apply = _RECORDED_APPLY  # type: ignore[attr-defined]
        _FAST.on()
    else:
        if _BELOW.__dict__.get("apply") is _RECORDED_APPLY:
            del _BELOW.apply  # type: ignore[attr-defined]
        _FAST.off()


class _FastPath:
    """Modules with a native fast path (``TransformerEncoder``, ``TransformerEncoderLayer``,
    ``MultiheadAttention`` in eval/no_grad) take it only when no torch function mode is on: called
    outside every watched call while the recorder is on the stack (a distillation teacher, an
    unwatched encoder), they would compute otherwise (padded rows, rounding). While the recorder is
    on, two global module hooks take it off the stack for such a call and record the call as one
    outside call (replayed as itself); modules a hunt watches are left to their hunt."""

    def __init__(self) -> None:
        self.ids: tuple[int, int] | None = None  # (pre-hook, hook): torch's handle ids, taken once
        self.live = False  # the hooks are in torch's dicts
        self.inside: Any = None  # the fast-path module whose call runs with the recorder off
        self.thread = 0  # ... on this thread
        self.rng: torch.Tensor | None = None

    def on(self) -> None:
        # put in and taken out by their ids at every root call, as registering and removing them
        # would (each goes last among the global hooks), without a handle and its weakrefs each time
        if self.live:
            return
        if self.ids is None:
            self.ids = (module_mod.register_module_forward_pre_hook(self._pre).id,
                        module_mod.register_module_forward_hook(self._post, with_kwargs=True, always_call=True).id)
        else:
            a, b = self.ids
            module_mod._global_forward_pre_hooks[a] = self._pre
            module_mod._global_forward_hooks[b] = self._post
            module_mod._global_forward_hooks_with_kwargs[b] = True
            module_mod._global_forward_hooks_always_called[b] = True
        self.live = True

    def off(self) -> None:
        if self.inside is not None:
            return  # inside the call: its post-hook puts things back, then the next off() removes these
        if self.live and self.ids is not None:
            a, b = self.ids
            module_mod._global_forward_pre_hooks.pop(a, None)
            module_mod._global_forward_hooks.pop(b, None)
            module_mod._global_forward_hooks_with_kwargs.pop(b, None)
            module_mod._global_forward_hooks_always_called.pop(b, None)
            self.live = False

    def _pre(self, module: Any, args: Any) -> None:
        m = _SWITCH.on
        if (self.inside is not None or m is None or not isinstance(module, _FAST_TYPES)
                or torch.compiler.is_compiling() or torch.overrides._get_current_function_mode() is not m
                or any(_watches(o, module) for o in _SWITCH.active)):
            return
        recs = [o for o in _SWITCH.active if not o.busy()]
        self.rng = torch.get_rng_state() if any(o.fresh for o in recs) else None
        self.inside = module
        self.thread = get_ident()
        torch._C._pop_torch_function_stack()

    def _post(self, module: Any, args: Any, kwargs: Any, output: Any = None) -> None:
        if self.inside is not module or self.thread != get_ident():
            return  # (another thread's call of the same module: the mode is this thread's to put back)
        self.inside = None
        m = _SWITCH.on
        if m is not None:
            torch._C._push_on_torch_function_stack(m)
        else:
            self.off()
        if output is None or isinstance(kwargs, BaseException):
            return
        outs = [t for t in (output if isinstance(output, (tuple, list)) else (output,)) if isinstance(t, torch.Tensor)]
        src, fn = user_line()
        for o in [o for o in _SWITCH.active if not o.busy()]:
            o._record(module, args, kwargs, output, outs, "", self.rng, src, fn)


def _watches(o: Outside, module: Any) -> bool:
    h = o._hunt()
    if h is None:
        return False
    names = h._names
    return module is h._root or (names is not None and id(module) in names)


_FAST_TYPES = (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer, torch.nn.MultiheadAttention)
_FAST = _FastPath()


def _take_out(m: Any) -> bool:
    """Take ``m`` off this thread's torch function mode stack wherever it sits; the modes above it
    keep their order. False when it is not on the stack (we run inside its own handler: torch
    pushes it back when the handler returns)."""
    above = []
    found = False
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is m:
            found = True
            break
        above.append(top)
    for x in reversed(above):
        torch._C._push_on_torch_function_stack(x)
    return found


def _put_under(m: Any) -> None:
    """Put ``m`` under the user's modes on this thread's torch function mode stack: a user's mode
    entered before (around the forward) pops itself when its block ends, as it would without us (a
    mode pushed on top was what its exit popped: ``with torch.device(...)`` pops the top). Only
    the ``DeviceContext`` of ``torch.set_default_device`` (entered in Python: it keeps itself at the
    very bottom, and its exit asserts so) stays under it."""
    above = []
    while torch._C._len_torch_function_stack():
        above.append(torch._C._pop_torch_function_stack())
    above.reverse()  # bottom first
    n = 0
    while n < len(above) and isinstance(above[n], _DeviceContext) and "old_device" in vars(above[n]):
        n += 1
    for x in above[:n]:
        torch._C._push_on_torch_function_stack(x)
    torch._C._push_on_torch_function_stack(m)
    for x in above[n:]:
        torch._C._push_on_torch_function_stack(x)


class _Switch:
    """The one mode on the stack, recording for every hunt whose outside code runs now.

    Each hunt joins (`Outside.on`) when its root call returns and leaves (`Outside.off`) when its
    next root call starts or its step ends. It records for the hunts whose own root call is not
    running (a child's hunt sees its parent's code as outside code) and never nanhunt's own work
    (another hunt's hooks), so two hunts of one model, or of a child and its parent, each record
    what they would alone. The mode sits under every mode of the user's (`_put_under`) and is
    taken out from wherever it sits (`_take_out`): the user's modes enter and leave as they would
    without it.
    """

    def __init__(self) -> None:
        self.on: Outside | None = None  # the mode on the stack (the carrier)
        self.orphans: list[Outside] = []  # pass-through modes torch will push back (see `off`)
        self.active: list[Outside] = []  # the hunts it records for
        self._later: Any = None  # the one-shot module pre-hook of `sweep_later`

    def off(self) -> None:
        """Take the carrier out (a watched root call or nanhunt's own code runs); membership stays."""
        self.sweep()
        m = self.on
        if m is None:
            return
        self.on = None
        _route_apply(False)
        if not _take_out(m):  # we run inside its own handler: torch pushes it back when that
            # returns. It passes everything through until taken out at the next chance (`sweep`)
            m.stale = True
            self.orphans.append(m)

    def sweep(self) -> None:
        """Take out pass-through modes that torch pushed back (see `off`)."""
        for m in list(self.orphans):
            if m is self.on:
                continue
            if _take_out(m):
                self.orphans.remove(m)
                if not m.closed:
                    m.stale = False  # off the stack: it may be put on again
        if not self.orphans and self._later is not None:
            self._later.remove()  # (see sweep_later)
            self._later = None

    def sweep_later(self) -> None:
        """A closed hunt's mode is still on the main thread's stack (closed from inside its handler,
        as from a backward hook, or from another thread): no hunt of ours will sweep it. Take it out
        at the main thread's next module call, which runs outside every mode's handler, then drop
        the hook (a new watch() sweeps too)."""
        if self._later is not None:
            return

        def _sweep(module: Any, args: Any) -> None:
            if threading.current_thread() is not threading.main_thread() or torch.compiler.is_compiling():
                return
            self.sweep()

        self._later = module_mod.register_module_forward_pre_hook(_sweep)

    def leave(self, m: Outside) -> None:
        if m in self.active:
            self.active.remove(m)
        self.off()

    def turn_on(self, m: Outside) -> None:
        self.sweep()
        if m not in self.active:
            self.active.append(m)
        self.resume(m)

    def resume(self, m: Outside | None = None) -> None:
        if self.on is not None or not self.active:
            return
        if threading.current_thread() is not threading.main_thread() and any(
                o.thread != get_ident() for o in self.active):
            # a torch function mode sits on the calling thread's own stack, and only that thread can
            # pop it: left on a worker thread that ends (the switch is process-wide, close() runs
            # elsewhere), it aborted the process at exit. Code outside watched calls is recorded on
            # the main thread, and on a thread that opened every listening hunt itself (a training
            # loop run in a thread of its own: its steps and close() take the mode off there)
            return
        idle = [o for o in self.active if not o.busy()]
        if not idle:
            return  # every listening hunt's own root call is running
        c = m if m is not None and m in idle else idle[-1]
        if c in self.orphans:  # still on the stack (pushed back by torch): take it out first
            _take_out(c)
            self.orphans.remove(c)
        c.stale = False
        _put_under(c)
        self.on = c
        _route_apply(True)


_SWITCH = _Switch()
# in-place calls that write their first argument besides ``name_`` ones
_AUGMENTED = frozenset(("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ipow__"))
_DATA = torch._C.TensorBase.__dict__["data"]  # ``p.data = new``: its ``__set__`` replaces p's values


_DROPS: dict[int, frozenset[int]] = {}  # id(Outside) -> storages whose writes are dropped (see Outside.drop_writes)


def _writes(func: Any, name: str) -> bool:
    """``func`` (named ``name``) writes its first argument in place (``p.data = new`` too)."""
    return (name in _AUGMENTED or (name.endswith("_") and not name.startswith("__"))
            or (name == "__set__" and getattr(func, "__self__", None) is _DATA))


def _writes_dropped(func: Any, args: Any) -> bool:
    if not _writes(func, getattr(func, "__name__", "")):
        return False
    ts = args[0] if isinstance(args[0], (list, tuple)) else (args[0],)
    return any(isinstance(t, torch.Tensor) and storage_of(t) in stores for stores in _DROPS.values() for t in ts)


def _dropped(func: Any, args: Any) -> Any:
    """What a dropped in-place call returns: its target (``p -= u`` rebinds ``p`` to it, ``p.add_``
    returns it), None where the call itself returns None (``x[i] = v``, ``p.data = v``, foreach)."""
    name = getattr(func, "__name__", "")
    return None if name in ("__setitem__", "__set__") or name.startswith("_foreach") else args[0]


class Outside(TorchFunctionMode):
    """The hunt's outside-code recorder; see the module docstring."""

    def __init__(self, hunt: Hunt) -> None:
        super().__init__()
        self._hunt = weakref.ref(hunt)
        self.thread = get_ident()  # the thread that opened the hunt (see _Switch.resume)
        self.stale = False  # passes everything through (see _Switch.off, close)
        self.closed = False
        self.fresh = True  # the next recorded call is the first since a root call: keep the RNG
        self.held = False  # torch runs the hooks after an exception in a forward: not on meanwhile (Hunt._post)
        _SWITCH.sweep()

    def busy(self) -> bool:
        h = self._hunt()
        return h is not None and bool(h._stack)

    def on(self) -> None:
        """A root call returned: code from here on is outside every watched call."""
        if self.held:
            return
        self.fresh = True
        _SWITCH.turn_on(self)

    def off(self) -> None:
        _SWITCH.leave(self)

    def drop_writes(self, storages: frozenset[int]) -> None:
        """``on_find="skip"`` dropped the step at a hand-written update: its in-place writes into
        these storages (the model's parameters) are not made, the one in flight and every one
        until `keep_writes` (the model's next call). Seen by whichever mode is on the stack, a
        stale one too (the step's judgement took this one out from inside its own handler)."""
        _DROPS[id(self)] = storages

    def keep_writes(self) -> None:
        if _DROPS:
            _DROPS.pop(id(self), None)

    def close(self) -> None:
        self.keep_writes()
        _calls.clear()  # they hold the user's module globals (and through them, often the model)
        _SWITCH.sweep()
        if self in _SWITCH.active:
            _SWITCH.active.remove(self)
        if _SWITCH.on is self:
            _SWITCH.off()
        self.closed = True
        if self in _SWITCH.orphans:
            _SWITCH.sweep_later()
        self.stale = True  # if still on a stack (another thread's, or inside its handler): it passes everything through

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if _DROPS and args and _writes_dropped(func, args):
            return _dropped(func, args)
        if (self.stale or (type(func) in _OP_TYPES and func in _UNRECORDED) or torch.compiler.is_compiling()
                or (REPLAYING and get_ident() in REPLAYING) or _tracing_state() is not None):
            # a replay (any hunt's) is nobody's outside code; torch.jit.trace of a part between
            # steps (an export) records every op run: the recorder's probes warned into its trace
            return func(*args, **kwargs)
        if in_transform():  # inside torch.func transforms (vmap/grad, per-sample gradients):
            return func(*args, **kwargs)  # not recorded, as module calls there are not (their tensors are wrapped)
        if _own_code(sys._getframe(1).f_code.co_filename):
            return func(*args, **kwargs)  # nanhunt's own work (another hunt's hooks): nobody's outside code
        recs = [m for m in _SWITCH.active if not m.busy()]
        if not recs:
            return func(*args, **kwargs)
        frame = _caller(1)
        if frame is False:
            return func(*args, **kwargs)
        call = _from_user_line(frame) if frame is not None else _plain_call
        if func in _BACKWARD:
            src, _ = user_line()
            for m in recs:
                h = m._hunt()
                if h is not None:
                    h._log.seeds.append((args, kwargs, src))
            return call(func, args, kwargs)
        if func in _PASS:  # torch.autograd.grad: its results are gradients, never fed from outside
            out = call(func, args, kwargs)
            refs = [weakref.ref(t) for t in out if isinstance(t, torch.Tensor)]
            second = bool(kwargs.get("create_graph", args[4] if len(args) > 4 else False))
            for m in recs:
                h = m._hunt()
                if h is not None:
                    h._log.grads_out.extend(refs)
                    h._log.second_order = h._log.second_order or second
            return out
        _rng_before = torch.get_rng_state() if any(m.fresh for m in recs) else None
        name = getattr(func, "__name__", "")
        if args and _writes(func, name):
            judged = []  # a write in place (or ``p.data = p.data - lr * p.grad``): a hand-written update of a model's parameters?
            for m in recs:
                h = m._hunt()
                if h is not None and not h._opts and h._log.backward and h._before_write(args[0]):
                    judged.append(m)
            if judged:  # the update is not outside code of the step just judged, nor of the next
                if _DROPS and _writes_dropped(func, args):  # on_find="skip" dropped the step
                    return _dropped(func, args)
                recs = [m for m in recs if m not in judged]
                if not recs:
                    return call(func, args, kwargs)
        before = _carried(name, args)
        out = call(func, args, kwargs)
        if name == "__get__" or name == "__set__":
            return out
        if type(out) is torch.Tensor or isinstance(out, torch.Tensor):
            outs: Any = (out,)
        elif isinstance(out, (tuple, list)):
            outs = [t for t in out if isinstance(t, torch.Tensor)]
        elif out is None and name == "__setitem__" and args and isinstance(args[0], torch.Tensor):
            outs = (args[0],)  # x[i] = v writes a new value into x
        elif func is _REGISTER_HOOK and _hooked_by_user():
            # a gradient hook the code put on its tensor: the replay of its backward runs it too
            # (not torch's own: a module's full backward hook registers one on each output)
            outs = ()
        else:
            return out
        if frame is None:
            src, fn = None, ""
        else:
            code = frame.f_code
            src, fn = f"{code.co_filename}:{frame.f_lineno}", getattr(code, "co_qualname", code.co_name)
        with _NO_SUBCLASS() if any(type(t) is not torch.Tensor for t in outs) else contextlib.nullcontext():
            for m in recs:  # (nanhunt's reads never go through the user's tensor subclass)
                m._record(func, args, kwargs, out, outs, name, _rng_before, src, fn, before)
        return out

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any, outs: Any, name: str,
                rng_before: torch.Tensor | None, src: str | None, fn: str,
                before: torch.Tensor | None = None) -> None:
        """One torch call made outside this hunt's watched calls, into its step log."""
        h = self._hunt()
        if h is None or h._paused or h._closed:
            return
        ops = getattr(h, "_mode", None)  # mode="ops": our probes are not the user's ops
        if ops is not None:
            ops.muted += 1
        try:
            log: StepLog = h._log
            ri = len(log.outside)
            rng = None
            if self.fresh:
                rng, self.fresh = rng_before, False
            log.outside.append(OutRec(func, args, kwargs, out, src, fn, rng, _autocast(), _tick()))
            if h._quiet_outside:  # (ignore="<outside>": recorded for the chains, not judged)
                return
            writes = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
            for j, t in enumerate(outs):
                if not writes and any(t is a for a in args):
                    continue  # handed back as it came (.to() its own device, .contiguous()): nothing made here
                if is_checked(t) and t.numel() and not t.is_meta and (writes or not t._is_view()):
                    p = probe(t)
                    if before is not None and j == 0:
                        # an accumulator already non-finite before this step's write (running +=
                        # loss after a NaN step): carried on, not born here; judged finite
                        p = torch.where(before, p, 0.0)
                    log.sums.append(p)
                    log.meta.append(Out(ri, j))
        finally:
            if ops is not None:
                ops.muted -= 1
