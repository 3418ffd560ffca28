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

from fnmatch import fnmatchcase

import torch
from torch import nn

from .._steplog import Buffers, Top
from .._tensors import stack_probes
from .protect import buffer_slots

__all__ = ["BufferState"]

_MAX_NUMEL = 1 << 20


_Slots = list[tuple[dict[str, torch.Tensor | None], str, str]]


class BufferState:
    def __init__(self) -> None:
        self._slots: dict[nn.Module, _Slots] = {}

    def capture(self, top: Top, taken: dict[int, torch.Tensor] | None = None) -> None:
        """``taken``: copies of buffers (by id of the buffer) made just before this call."""
        slots = self._slots.get(top.module)
        if slots is None:
            slots = self._slots[top.module] = _floating_slots(top.module)
        if not slots:
            return
        with torch.no_grad():
            saved: dict[int, torch.Tensor] = {}
            for d, k, _ in slots:
                b = d.get(k)
                if b is not None and id(b) not in saved:
                    c = taken.get(id(b)) if taken else None
                    saved[id(b)] = c if c is not None else b.detach().clone()
            top.saved = saved

    def probe(self, top: Top, ignore: tuple[str, ...]) -> tuple[torch.Tensor, Buffers] | None:
        """The buffers of ``top``'s module (the step's first root call) that are non-finite now
        and were finite when it began: a device-side vector, ``-inf`` for each (no host read).
        Written in place by a forward (BatchNorm's running statistics overflowing on a huge but
        finite batch) they change no output: nothing else would see them before evaluation.
        A buffer that was already non-finite (a mask), or replaced during the step, is not judged."""
        slots = self._slots.get(top.module)
        if not slots or not top.saved:
            return None
        names: list[str] = []
        now: list[torch.Tensor] = []
        before: list[torch.Tensor] = []
        for d, k, n in slots:
            b = d.get(k)
            c = top.saved.get(id(b)) if b is not None else None
            if c is None or b is None or not b.numel() or c.shape != b.shape:
                continue
            if ignore and any(fnmatchcase(n.rpartition(".")[0], p) for p in ignore):
                continue
            names.append(n)
            now.append(b)
            before.append(c)
        if not now:
            return None
        with torch.no_grad():
            ok = (stack_probes([torch.isfinite(b).all() for b in now])
                  | ~stack_probes([torch.isfinite(c).all() for c in before]).to(now[0].device))
            return ok.to(torch.float32).log(), Buffers(names, now)  # log(0) = -inf: newly non-finite

    def clear(self) -> None:
        self._slots.clear()


def _floating_slots(root: nn.Module) -> _Slots:
    """(a module's buffer dict, key, qualified name) of each floating buffer of ``root``; none past
    ``_MAX_NUMEL``."""
    out = [(d, k, n) for d, k, n in buffer_slots(root) if _floating(d[k])]
    return out if sum(_numel(d[k]) for d, k, _ in out) <= _MAX_NUMEL else []


def _floating(b: torch.Tensor | None) -> bool:
    return b is not None and (b.is_floating_point() or b.is_complex())


def _numel(b: torch.Tensor | None) -> int:
    return b.numel() if b is not None else 0
