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

Several hunts (``nanhunt run``) share one switch: at most one mode is on the stack, the one of the
hunt whose root returned last, and none while any watched root call runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections.abc import Iterator
from threading import get_ident
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from .._hooks import REPLAYING
from .._steplog import Out, OutRec, StepLog
from .._tensors import probe

if TYPE_CHECKING:
    from .hunt import Hunt

__all__ = ["Outside", "user_line"]

_BACKWARD = frozenset({torch.Tensor.backward, torch.autograd.backward})
_PASS = frozenset({torch.autograd.grad})
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_NANHUNT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_lib: dict[str, bool] = {}


def _is_lib(filename: str) -> bool:
    k = _lib.get(filename)
    if k is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        k = (path.startswith(_TORCH_DIR) or path.startswith(_NANHUNT_DIR) or filename.startswith("<frozen")
             or (path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path[len(_STDLIB_DIR):]))
        _lib[filename] = k
    return k


def user_line(depth: int = 2) -> tuple[str | None, str]:
    """``file:line`` and function name of the first frame outside torch, nanhunt and the stdlib."""
    f: Any = sys._getframe(depth)
    while f is not None:
        code = f.f_code
        if not _is_lib(code.co_filename):
            return f"{code.co_filename}:{f.f_lineno}", getattr(code, "co_qualname", code.co_name)
        f = f.f_back
    return None, ""


class _Switch:
    """Which hunt's mode is on the stack (at most one, shared by every open hunt)."""

    def __init__(self) -> None:
        self.on: Outside | None = None
        self.modes: weakref.WeakSet[Outside] = weakref.WeakSet()

    def off(self) -> None:
        m = self.on
        if m is None:
            return
        self.on = None
        if torch._C._len_torch_function_stack() and torch.overrides._get_current_function_mode() is m:
            torch._C._pop_torch_function_stack()
        else:  # a mode the user pushed sits above ours: ours stays, switched to pass-through
            m.stale = True

    def turn_on(self, m: Outside) -> None:
        if self.on is m:
            return
        self.off()
        if any(o.busy() for o in self.modes):
            return  # a watched root call of another hunt is running
        if m.stale:
            m.stale = False  # still on the stack under the user's mode
        else:
            torch._C._push_on_torch_function_stack(m)
        self.on = m


_SWITCH = _Switch()


class Outside(TorchFunctionMode):
    """The hunt's outside-code recorder; see the module docstring."""

    def __init__(self, hunt: Hunt) -> None:
        super().__init__()
        self._hunt = weakref.ref(hunt)
        self.stale = False
        self.quiet = 0
        self.fresh = True  # the next recorded call is the first since a root call: keep the RNG
        _SWITCH.modes.add(self)

    def busy(self) -> bool:
        h = self._hunt()
        return h is not None and bool(h._stack)

    def on(self) -> None:
        """A root call returned: code from here on is outside every watched call."""
        self.fresh = True
        _SWITCH.turn_on(self)

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """nanhunt's own tensor work in code where the mode is on (``hunt.check``): off the stack
        for its duration (a pop and a push: cheaper than passing each call through)."""
        was_on = _SWITCH.on is self
        if was_on:
            _SWITCH.off()
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1
            if was_on:
                _SWITCH.turn_on(self)

    def off(self) -> None:
        if _SWITCH.on is not None:
            _SWITCH.off()

    def close(self) -> None:
        if _SWITCH.on is self:
            _SWITCH.off()
        self.stale = True  # left under a user's mode: it passes everything through
        _SWITCH.modes.discard(self)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.stale or self.quiet or torch.compiler.is_compiling() or (REPLAYING and get_ident() in REPLAYING):
            return func(*args, **kwargs)  # a replay (any hunt's) is nobody's outside code
        if func in _BACKWARD:
            h = self._hunt()
            if h is not None:
                src, _ = user_line()
                h._log.seeds.append((args, kwargs, src))
            return func(*args, **kwargs)
        if func in _PASS:
            return func(*args, **kwargs)
        _rng_before = torch.get_rng_state() if self.fresh else None
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__" or name == "__set__":
            return out
        if type(out) is torch.Tensor or isinstance(out, torch.Tensor):
            outs: Any = (out,)
        elif isinstance(out, (tuple, list)):
            outs = [t for t in out if isinstance(t, torch.Tensor)]
        elif out is None and name == "__setitem__" and args and isinstance(args[0], torch.Tensor):
            outs = (args[0],)  # x[i] = v writes a new value into x
        else:
            return out
        h = self._hunt()
        if h is None or h._paused or h._closed:
            return out
        ops = getattr(h, "_mode", None)  # mode="ops": our probes are not the user's ops
        if ops is not None:
            ops.muted += 1
        try:
            log: StepLog = h._log
            ri = len(log.outside)
            src, fn = user_line()
            rng = None
            if self.fresh:
                rng, self.fresh = _rng_before, False
            log.outside.append(OutRec(func, args, kwargs, out, src, fn, rng))
            writes = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
            for j, t in enumerate(outs):
                if (t.is_floating_point() or t.is_complex()) and t.numel() and (writes or not t._is_view()):
                    log.sums.append(probe(t))
                    log.meta.append(Out(ri, j))
        finally:
            if ops is not None:
                ops.muted -= 1
        return out
