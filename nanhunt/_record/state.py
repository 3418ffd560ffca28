"""The state a root call starts from: its floating buffers (and small integer ones: counters,
flags) as they were before the call.

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
from operator import is_

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._steplog import Buffers, Top
from .._tensors import stack_probes, strided, widen
from .protect import buffer_slots

__all__ = ["BufferState"]

_MAX_NUMEL = 1 << 20
_FLAG_NUMEL = 16


_Slots = list[tuple[dict[str, torch.Tensor | None], str, str]]


class BufferState:
    def __init__(self) -> None:
        self._slots: dict[nn.Module, _Slots] = {}
        self._flags: dict[nn.Module, _Slots] = {}  # small integer/bool buffers (see _small_slots)
        # the last probe's buffers (by identity) and their device-side "non-finite" flags: the
        # state the next step starts from, so that a step probes its buffers once, not twice
        self._last: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def capture(self, top: Top, taken: dict[int, torch.Tensor] | None = None) -> None:
        """``taken``: copies of buffers (by id of the buffer) made just before this call."""
        slots = self._slots.get(top.module)
        if slots is None:
            slots = _floating_slots(top.module)
            if slots is None:
                return  # a lazy module's buffers get their values in this call: found at the next
            self._slots[top.module] = slots
            self._flags[top.module] = _small_slots(top.module)
        flags = self._flags.get(top.module, [])
        if not slots and not flags:
            return
        with torch.no_grad():
            saved: dict[int, torch.Tensor] = {}
            for d, k, _ in (*slots, *flags):
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
            if c is None or b is None or not b.numel() or c.shape != b.shape or b.is_meta:
                continue  # (a meta placeholder: no values)
            if ignore and any(fnmatchcase(n.rpartition(".")[0], p) for p in ignore):
                continue
            names.append(n)
            now.append(b)
            before.append(c)
        if not now:
            return None
        with torch.no_grad():
            bad_now = _bad(now)
            last = self._last
            if last is not None and len(last[0]) == len(now) and all(map(is_, last[0], now)):
                bad_before = last[1]  # this step began where the last one ended
            else:  # the first step, or other buffers: judged on the copies taken when the step began
                bad_before = _bad(before)
            self._last = (now, bad_now)
            fresh = bad_now & ~bad_before.to(bad_now.device)
            return (~fresh).to(torch.float32).log(), Buffers(names, now)  # log(0) = -inf: newly non-finite

    def forget(self) -> None:
        """The buffers were put back (a restore after a finding): the last probe is not where the
        next step begins."""
        self._last = None

    def clear(self) -> None:
        self._slots.clear()
        self._flags.clear()
        self._last = None


def _bad(ts: list[torch.Tensor]) -> torch.Tensor:
    """One "non-finite?" flag per tensor, on the first one's device: one fused multi-tensor
    reduction per (device, dtype) on CUDA (a loop in C++ on CPU). A sum of magnitudes: NaN and
    Inf propagate; a finite tensor whose magnitudes sum past the dtype's range is flagged too
    (the analysis judges exactly, and the next step starts from it)."""
    ts = [widen(strided(t)) for t in ts]  # a sparse buffer (a fixed sparse mask): its stored values; float8 as float32
    try:
        return ~torch.isfinite(torch.stack(torch._foreach_norm(ts, 1)))
    except RuntimeError:  # several devices or dtypes
        return ~torch.isfinite(stack_probes([torch.linalg.vector_norm(t, 1) for t in ts]))


def _floating_slots(root: nn.Module) -> _Slots | None:
    """(a module's buffer dict, key, qualified name) of each floating buffer of ``root``; none past
    ``_MAX_NUMEL``; None while a lazy module's buffer has no values yet."""
    out = [(d, k, n) for d, k, n in buffer_slots(root) if _floating(d[k])]
    if any(is_lazy(b) for d, k, _ in out if (b := d[k]) is not None):
        return None
    return out if sum(_numel(d[k]) for d, k, _ in out) <= _MAX_NUMEL else []


def _small_slots(root: nn.Module) -> _Slots:
    """The small integer and bool buffers of ``root`` (a BatchNorm's ``num_batches_tracked``, a
    data-dependent init's ``initialized`` flag): a replay starts from their values before the call
    too, or it skips what the call did on its first batch (Glow's ActNorm set its scale there)."""
    return [(d, k, n) for d, k, n in buffer_slots(root)
            if (b := d[k]) is not None and not _floating(b) and not is_lazy(b) and not b.is_meta
            and b.numel() <= _FLAG_NUMEL]


def _floating(b: torch.Tensor | None) -> bool:
    return b is not None and (b.is_floating_point() or b.is_complex())


def _numel(b: torch.Tensor | None) -> int:
    return b.numel() if b is not None else 0
