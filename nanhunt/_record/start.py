"""What was already non-finite when the watch began.

A weight loaded with NaN (a poisoned checkpoint, a row set by hand before ``watch()``) stays
non-finite through every optimizer step and every forward that reads it; without knowing that it
came in that way the analysis would call the first optimizer step that carries it "created" (an
overflow that never happened) and blame "an earlier optimizer step" for a poisoned forward.

At the first step's start the model's parameters and buffers and the watched optimizers' state
are probed exactly, once (a device-side flag each, no read); the flags are read on a hit only.
Only weak references are kept: a tensor that dies (optimizer state replaced) is forgotten.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._tensors import is_checked, local, optimizer_tensors, own_tensors, stack_probes, version, widen

__all__ = ["StartState"]

_INF = float("inf")


class StartState:
    """Exact "non-finite?" flags of the watched state (and the parameters' ``.grad`` then) as it was
    when the first step began."""

    __slots__ = ("pending", "_refs", "_flags", "_bad", "versions")

    def __init__(self) -> None:
        self.pending = True  # not captured yet (the first step has not begun)
        self.versions: dict[int, int] = {}  # id -> version counter of each parameter of the model, then
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self._flags: torch.Tensor | None = None
        self._bad: list[weakref.ref[torch.Tensor]] = []

    def capture(self, root: nn.Module, opts: Sequence[torch.optim.Optimizer]) -> None:
        """The first step begins: flag what is non-finite now (device side, no read)."""
        self.pending = False
        self.versions = {id(p): version(p) for p in root.parameters() if not is_lazy(p)}  # (no values yet: no counter)
        seen: set[int] = set()
        tens: list[torch.Tensor] = []
        mine: list[torch.Tensor] = []  # what this rank holds of each (FSDP2: its shard, maybe empty)
        grads = [p.grad for p in root.parameters() if p.grad is not None]  # (a backward's before the watch, not zeroed)
        for t in [t for _, t in own_tensors(root)] + [t for o in opts for t in optimizer_tensors(o)[1]] + grads:
            if id(t) not in seen and _judgeable(t):
                seen.add(id(t))
                lt = local(t)
                if lt.numel():
                    tens.append(t)
                    mine.append(lt)
        if not tens:
            return
        with torch.no_grad():
            # exact (a sum could overflow for a huge finite tensor: the largest magnitude cannot, and
            # is NaN/inf exactly when an element is) and with no tensor-sized temporary; once per hunt
            self._flags = ~torch.isfinite(stack_probes([torch.linalg.vector_norm(widen(lt), _INF) for lt in mine]))
        self._refs = [weakref.ref(t) for t in tens]

    def bad(self) -> tuple[torch.Tensor, ...]:
        """The tensors, still alive, that were non-finite when the first step began (on a hit:
        reads the flags back the first time)."""
        if self._flags is not None:
            flags = self._flags.tolist()
            self._bad = [r for r, f in zip(self._refs, flags) if f]
            self._refs, self._flags = [], None
        return tuple(t for r in self._bad if (t := r()) is not None)


def _judgeable(t: torch.Tensor) -> bool:
    return is_checked(t) and t.layout is torch.strided and not t.is_meta and t.numel() > 0
