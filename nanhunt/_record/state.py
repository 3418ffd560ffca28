"""The state a root call starts from: its floating buffers as they were before the call.

A finding's ``cause`` is judged on the state at the start of the failing call, and a replay starts
from it: a BatchNorm's running statistics written non-finite by the very call that failed do not
make it ``"parameter"``. (Version counters cannot tell: ``native_batch_norm`` updates the running
statistics without bumping them.) Per top-level call, one device-side clone of each floating
buffer of the root (the list is cached per root; BatchNorm statistics are a few hundred numbers);
roots whose floating buffers hold more than ``_MAX_NUMEL`` values (caches) are not snapshotted.
No host read.
"""

from __future__ import annotations

import torch
from torch import nn

from .._steplog import Top

__all__ = ["BufferState"]

_MAX_NUMEL = 1 << 20


class BufferState:
    def __init__(self) -> None:
        self._buffers: dict[nn.Module, list[torch.Tensor]] = {}

    def capture(self, top: Top) -> None:
        bufs = self._buffers.get(top.module)
        if bufs is None:
            bufs = [b for b in top.module.buffers() if b.is_floating_point() or b.is_complex()]
            if sum(b.numel() for b in bufs) > _MAX_NUMEL:
                bufs = []
            self._buffers[top.module] = bufs
        if bufs:
            with torch.no_grad():
                top.saved = {id(b): b.detach().clone() for b in bufs}

    def clear(self) -> None:
        self._buffers.clear()
