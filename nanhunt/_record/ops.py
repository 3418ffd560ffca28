"""``mode="ops"``: every aten op checked from the start, for users who accept the cost.

A `TorchDispatchMode` kept on for the whole watch probes each floating output of each op (forward
and backward) into the step's log, the same device-side way the module hooks do. On a hit the
first non-finite op is known even when a replay cannot reproduce the step; in backward it is the
autograd node that ran it. Costs a probe per op (see the benchmark): a debugging setting.

`OpsHunt` is the `Hunt` of this mode: its own hooks run with the mode muted, so nanhunt's tensor
work is never recorded as the user's ops. The mode knows nothing of the hunt but one callback.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as module_mod
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._hooks import replaying_here
from .._steplog import Op
from .._tensors import is_checked, probe
from .hunt import Hunt

__all__ = ["OpsHunt"]

_SKIP = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default, torch.ops.aten.alias.default}


class _OpsMode(TorchDispatchMode):
    """Hands each op's outputs to ``sink(op, autograd node or None, outputs)`` unless muted."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # the user's torch.compile'd code stays compiled: any other mode makes dynamo run every
        # frame eagerly (outputs no longer the compiled ones, a NaN only the compiled graph makes
        # never made); compiled graphs are judged by full mode's in-graph checks
        return True

    def __init__(self, sink: Callable[[str, str | None, list[torch.Tensor]], None]) -> None:
        super().__init__()
        self.sink = sink
        self.muted = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.muted or func in _SKIP:
            return out
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outs:
            backward = torch._C._current_graph_task_id() != -1
            node = type(torch._C._current_autograd_node()).__name__ if backward else None
            self.sink(str(func), node, outs)
        return out


class OpsHunt(Hunt):
    """A `Hunt` with every aten op probed; its own work runs with the op mode muted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._mode = _OpsMode(self._record_op)
        self._mode.muted += 1
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._mode.muted -= 1
        self._mode.__enter__()
        self._mode_thread = threading.current_thread()  # (a dispatch mode sits on this thread's own stack)

    def _record_op(self, op: str, node: str | None, outs: list[torch.Tensor]) -> None:
        if self._paused or self._closed or replaying_here():
            return
        log = self._log
        ci = self._stack[-1].index if self._stack and node is None else -1
        self._mode.muted += 1
        try:
            for j, t in enumerate(outs):
                if is_checked(t) and t.numel():
                    log.sums.append(probe(t))
                    log.meta.append(Op(op, node, ci, j))
        finally:
            self._mode.muted -= 1

    def _muted(name: str) -> Any:  # type: ignore[misc]
        def run(self: OpsHunt, *args: Any, **kwargs: Any) -> Any:
            self._mode.muted += 1
            try:
                return getattr(Hunt, name)(self, *args, **kwargs)
            finally:
                self._mode.muted -= 1

        run.__name__ = name
        return run

    # nanhunt's own code that runs tensor ops while the mode is on
    _pre = _muted("_pre")
    _post = _muted("_post")
    _on_grad = _muted("_on_grad")
    _pre_step = _muted("_pre_step")
    _post_step = _muted("_post_step")
    _closure = _muted("_closure")
    _end_step = _muted("_end_step")
    check = _muted("check")
    del _muted

    def _release(self) -> None:
        try:
            self._mode_out()
        finally:
            super()._release()

    def _mode_out(self) -> None:
        """Take the op mode off the stack of the thread that opened the hunt. Only that thread can pop
        it, and only from the top: closed from another thread (a server's shutdown while the training
        thread is mid-step; popping there failed and left every hook on), or under another mode (a
        hunt opened later, a mode of the user's), it passes every op through until it is on top of
        that thread's stack at a close or a module call (`_sweep`)."""
        self._mode.muted += 1  # for good
        global _SWEEP
        with _LOCK:
            _ORPHANS.append((self._mode, self._mode_thread))
            if _SWEEP is None:
                _SWEEP = module_mod.register_module_forward_pre_hook(_sweep)
        _sweep()


_LOCK = threading.Lock()
_ORPHANS: list[tuple[_OpsMode, threading.Thread]] = []  # closed hunts' modes still on a thread's stack
_SWEEP: Any = None  # the module pre-hook that takes them out (while there are any)


def _sweep(*_: Any) -> None:
    """Pop the closed hunts' modes on top of this thread's dispatch stack (one that ended took its
    stack with it); the hook goes when none is left."""
    global _SWEEP
    me = threading.current_thread()
    with _LOCK:
        again = True
        while again:
            again = False
            for mode, thread in list(_ORPHANS):
                n = torch._C._len_torch_dispatch_stack()
                if not thread.is_alive():
                    _ORPHANS.remove((mode, thread))
                elif thread is me and n and torch._C._get_dispatch_stack_at(n - 1) is mode:
                    _ORPHANS.remove((mode, thread))
                    mode.__exit__(None, None, None)
                    again = True
        if not _ORPHANS and _SWEEP is not None:
            _SWEEP.remove()
            _SWEEP = None
