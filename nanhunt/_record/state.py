"""The state a root call starts from: its floating buffers as they were before the call.

A finding's ``cause`` is judged on the state at the start of the failing call, and a replay starts
from it: a BatchNorm's running statistics written non-finite by the very call that failed do not
make it ``"parameter"``. (Version counters cannot tell: ``native_batch_norm`` updates the running
statistics without bumping them.) Per top-level call, one device-side copy of each floating
buffer of the root (BatchNorm statistics are a few hundred numbers), looked up afresh each time
(a buffer replaced by assignment is the one copied); roots whose floating buffers hold more than
``_MAX_NUMEL`` values (caches) are not snapshotted. At a step's first call in raise/skip mode the
copies `protect.BufferBackup` has just taken are used, not taken twice. No host read.
"""

from __future__ import annotations

import torch
from torch import nn

from .._steplog import Top
from .protect import buffer_slots

__all__ = ["BufferState"]

_MAX_NUMEL = 1 << 20


class BufferState:
    def __init__(self) -> None:
        self._slots: dict[nn.Module, list[tuple[dict[str, torch.Tensor | None], str]]] = {}

    def capture(self, top: Top, taken: dict[int, torch.Tensor] | None = None) -> None:
        """``taken``: copies of buffers (by id of the buffer) made just before this call."""
        slots = self._slots.get(top.module)
        if slots is None:
            slots = self._slots[top.module] = _floating_slots(top.module)
        if not slots:
            return
        with torch.no_grad():
            saved: dict[int, torch.Tensor] = {}
            for d, k in slots:
                b = d.get(k)
                if b is not None and id(b) not in saved:
                    c = taken.get(id(b)) if taken else None
                    saved[id(b)] = c if c is not None else b.detach().clone()
            top.saved = saved

    def clear(self) -> None:
        self._slots.clear()


def _floating_slots(root: nn.Module) -> list[tuple[dict[str, torch.Tensor | None], str]]:
    """(a module's buffer dict, key) of each floating buffer of ``root``; none past ``_MAX_NUMEL``."""
    out = [(d, k) for d, k, _ in buffer_slots(root) if _floating(d[k])]
    return out if sum(_numel(d[k]) for d, k in out) <= _MAX_NUMEL else []


def _floating(b: torch.Tensor | None) -> bool:
    return b is not None and (b.is_floating_point() or b.is_complex())


def _numel(b: torch.Tensor | None) -> int:
    return b.numel() if b is not None else 0
