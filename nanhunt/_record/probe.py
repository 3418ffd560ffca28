"""Fused device-side probes for many tensors at once (gradients, parameters, optimizer state).

No probe reads anything back to the host (single tensors: ``_tensors.probe``).

On CPU the cost of checking many small tensors is dispatch, not memory: a sum per tensor is
~2-3 us of dispatch each, so a 98-parameter AdamW model paid ~0.8 ms a step for its 294
parameter and state tensors. `fused_probe` checks the small float32 tensors with one dispatch
for them all (GradScaler's check-and-unscale kernel, by an inverse scale of 1: see `_check_all`;
before it, one ``torch.cat`` and sum per trailing shape: 145 us against 320 us one by one for
those 294 tensors, and still the way for a list where one tensor overlaps itself) and only large
tensors one by one (for them the copy would cost more than the dispatch it saves). The result is a :class:`Fused`:
its ``summary`` (a few sums) is what the step's sync reads; :meth:`Fused.flags` says which
tensor is non-finite, computed only after a hit (the tensors are held until the step ends anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import is_, itemgetter
from typing import Any

import torch

from .._tensors import add_chunked, any_bad, grain, local, optimizer_tensors, probe_sum, real_view

__all__ = ["fused_probe", "Fused", "GradProbe", "OptimizerProbe"]

_F32 = torch.float32
# The small float32 tensors are checked by the kernel GradScaler unscales with, in one dispatch for
# the whole list (the benchmark MLP's 98 gradients: 37 us, against 58 us for a copy and sum per
# shape on one thread and about the same on two, idle; 0.5 M fewer instructions a step in all, and
# no thread pool to wake on a busy machine): it writes each tensor back in place, and with an inverse scale of 1 it writes each value as it
# read it, bit for bit; below autograd's in-place layer, no version counter moves either (a saved
# tensor stays valid). Only tensors that the optimizer's step writes or reads anyway come here.
_check_all = torch._amp_foreach_non_finite_check_and_unscale_
_BelowAutograd = torch._C._AutoDispatchBelowADInplaceOrView
_ONE = torch.ones(1)
_ALONE = 1 << 16  # elements (one thread): from this size a tensor is summed alone, not copied (see benchmarks/README.md)


class Fused:
    """Device-side sums of a list of tensors: ``summary`` non-finite iff some tensor may be.

    ``flags()`` (after a hit only) says which tensors are non-finite."""

    __slots__ = ("summary", "tensors")

    def __init__(self, summary: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        self.summary = summary
        self.tensors = tensors

    def flags(self) -> list[bool]:
        """Which tensors are non-finite (after a hit: reads back). All clear when the summary was
        finite when probed, whatever was written into the tensors since (the user's own writes
        between an optimizer step and the next sync are judged by the next probes, not this one)."""
        if not any_bad(self.summary):
            return [False] * len(self.tensors)
        return (~torch.isfinite(_per_tensor(self.tensors))).tolist()


def fused_probe(tensors: list[torch.Tensor]) -> torch.Tensor | Fused:
    """Probe many tensors: a float32 vector (one element per tensor, in order), or on CPU a
    :class:`Fused` whose summary covers them all with far fewer dispatches.

    Elsewhere one fused ``_foreach_norm`` per (device, dtype) already is one launch."""
    tensors = [local(t) for t in tensors]  # FSDP2: each rank judges its own shard
    return _run(_plan(tensors), tensors)


class _Plan:
    """How to probe a list of tensors, by position: worked out once for a list whose tensors keep
    their shapes, dtypes and devices (see `OptimizerProbe`, `GradProbe`)."""

    __slots__ = ("groups", "rest", "cut", "joins", "small")

    def __init__(self, groups: list[list[int]] | None, rest: list[int], cut: int) -> None:
        self.groups = groups  # small float32 tensors by trailing shape (one `cat` each); None: not all on the CPU
        self.rest = rest  # summed one by one: large, 0-dim, other dtypes
        self.cut = cut  # `_tensors.grain()` when planned: a group's size limit (0: none)
        # per group: what picks its tensors out of the list (a tuple for `cat`, C-level), or its
        # one position (a group of one is summed as it is)
        self.joins: list[itemgetter[Any] | int] = [
            itemgetter(*g) if len(g) > 1 else g[0] for g in groups or ()]
        # what picks all the groups' tensors at once for `_check_all` (C-level; a tuple even for
        # one tensor, which it then holds twice)
        small = [i for g in groups or () for i in g]
        self.small: itemgetter[Any] | None = itemgetter(*small, *small[:1]) if len(small) == 1 else (
            itemgetter(*small) if small else None)


def _plan(tensors: list[torch.Tensor]) -> _Plan:
    cut = grain()
    limit = cut or _ALONE + 1
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    sizes: dict[tuple[int, ...], int] = {}
    rest: list[int] = []
    for i, t in enumerate(tensors):
        if not t.is_cpu:
            return _Plan(None, [], cut)
        n = t.numel()
        if t.dtype is _F32 and t.dim() and n < limit:
            # `cat` joins these without a view each. With a thread pool a group is cut before it
            # reaches ATen's grain, so its copy and sum run on this thread: waking the pool for
            # them cost more than the work (a 98-parameter AdamW's 294 tensors, two threads:
            # 323 us a step as one group, 185 us cut, measured in the step)
            add_chunked(groups, sizes, t.shape[1:], i, n, cut)
        else:
            rest.append(i)
    return _Plan([c for cs in groups.values() for c in cs], rest, cut)


def _run(plan: _Plan, tensors: list[torch.Tensor]) -> torch.Tensor | Fused:
    if not tensors:
        return torch.zeros(0)
    groups = plan.groups
    if groups is None:
        return _per_tensor(tensors)
    with torch.no_grad():  # one context for the list, no detach per tensor
        sums = []
        for i in plan.rest:
            t = tensors[i]
            sums.append(t.sum() if t.dtype is _F32 else probe_sum(t))
        small = plan.small
        if small is not None:
            found = torch.zeros(())
            try:
                with _BelowAutograd():
                    _check_all(small(tensors), found, _ONE)
            except RuntimeError:  # one of them overlaps itself (a gradient set to an expanded tensor)
                for j in plan.joins:
                    sums.append((tensors[j] if isinstance(j, int) else torch.cat(j(tensors))).sum())
            else:
                sums.append(found.atanh())  # 0 -> 0; 1 (some element non-finite) -> inf
        return Fused(torch.stack(sums), tensors)


class GradProbe:
    """The ``.grad`` of a list of parameters, probed before each ``step()``. A gradient has its
    parameter's shape, dtype and device (torch checks it), so the plan is made for the parameters
    and kept while the list holds the same ones (compared by identity, one C-level pass)."""

    __slots__ = ("_params", "_plan")

    def __init__(self) -> None:
        self._params: list[torch.Tensor] = []
        self._plan: _Plan | None = None

    def probe(self, params: Sequence[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor | Fused:
        if any(type(g).__name__ == "DTensor" for g in grads[:1]):  # FSDP2: local shards, planned each time
            return fused_probe(grads)
        if self._plan is None or not _same(params, self._params) or self._plan.cut != grain():
            self._plan = _plan(grads)
            self._params = list(params)
        return _run(self._plan, grads)


class OptimizerProbe:
    """The parameters and state of one optimizer, probed after each ``step()``.

    Working out which tensors those are is a Python walk over every parameter's state (about 1 ms
    a step for a 98-parameter AdamW, more than the probe itself): it is done once and reused while
    the optimizer holds the same objects (compared by identity, one C-level pass). A state entry
    replaced by another object (``load_state_dict``, LBFGS's direction, a new parameter group)
    makes it walk again."""

    __slots__ = ("opt", "_sig", "items", "tensors", "_plan")

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self._sig: list[object] = []
        self.items: list[tuple[torch.Tensor, str]] = []
        self.tensors: list[torch.Tensor] = []
        self._plan: _Plan | None = None  # None for sharded (DTensor) state: its local shards are new objects

    def _signature(self) -> list[object]:
        """The parameters, the state dict, then every state value (C-level passes: looking each
        parameter up in ``opt.state`` hashes it in Python, ~25 us a step for 98 parameters).
        Each parameter's state dict and its values are in the state's order, which changes only
        when an entry is added or replaced: then the walk is made again."""
        state = self.opt.state
        sig: list[object] = [p for g in self.opt.param_groups for p in g["params"]]
        sig.append(state)
        sig.extend(state.values())
        sig.extend(chain.from_iterable(map(dict.values, state.values())))
        return sig

    def current(self) -> tuple[list[tuple[torch.Tensor, str]], list[torch.Tensor]]:
        """``(param, state key or "")`` per tensor, and the tensors (as ``optimizer_tensors``)."""
        sig = self._signature()
        if not _same(sig, self._sig):
            self.items, self.tensors = optimizer_tensors(self.opt)
            self._plan = _plan(self.tensors) if not any(type(t).__name__ == "DTensor" for t in self.tensors) else None
            self._sig = sig
        return self.items, self.tensors

    def prepare(self) -> None:
        """Work out the tensors now if that was never done (after the optimizer's first step, when
        its state exists): sentinel mode's first probe, steps later, then only checks the walk
        still holds, and a run pays the walk (~0.3 ms for a 98-parameter AdamW) on its first step."""
        if not self._sig:
            self.current()

    def probe(self) -> torch.Tensor | Fused:
        """The probe of `current()`'s tensors (call `current()` first)."""
        plan = self._plan
        if plan is None:
            return fused_probe(self.tensors)
        if plan.cut != grain():  # the intra-op thread count changed
            plan = self._plan = _plan(self.tensors)
        return _run(plan, self.tensors)


def _same(a: Sequence[object], b: Sequence[object]) -> bool:
    """The same objects in the same order (by identity: one C-level pass)."""
    return len(a) == len(b) and all(map(is_, a, b))


def _per_tensor(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 vector, one element per tensor, in order."""
    if not tensors:
        return torch.zeros(0)
    tensors = [local(t) for t in tensors]  # FSDP2: each rank judges its own shard
    if tensors[0].device.type == "cpu":
        try:
            with torch.no_grad():
                return torch.stack([
                    t.sum() if t.dtype is _F32 else probe_sum(t)
                    for t in tensors
                ])
        except RuntimeError:  # tensors on several devices
            pass
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    with torch.no_grad():
        if len(groups) == 1:
            ts = [real_view(t) for t in tensors]
            return torch.stack(torch._foreach_norm(ts, 2, dtype=_F32))
        dev = tensors[0].device
        out = torch.empty(len(tensors), dtype=_F32, device=dev)
        for (d, _), idx in groups.items():
            ts = [real_view(tensors[i]) for i in idx]
            norms = torch.stack(torch._foreach_norm(ts, 2, dtype=_F32)).to(dev, non_blocking=True)
            out[torch.tensor(idx, device=dev)] = norms
        return out
