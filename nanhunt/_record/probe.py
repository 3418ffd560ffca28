"""Fused device-side probes for many tensors at once (gradients, parameters, optimizer state).

No probe reads anything back to the host (single tensors: ``_tensors.probe``).

On CPU the cost of checking many small tensors is dispatch, not memory: a sum per tensor is
~2-3 us of dispatch each, so a 98-parameter AdamW model paid ~0.8 ms a step for its 294
parameter and state tensors. `fused_probe` sums every small float32 tensor in one pass over one
flat copy (``flatten_dense_tensors``: one dispatch for the list) and only large tensors one by one
(for them the copy would cost more than the dispatch it saves). The result is a :class:`Fused`:
its ``summary`` (a few sums) is what the step's sync reads; :meth:`Fused.flags` says which
tensor is non-finite, computed only after a hit (the tensors are held until the step ends anyway).
"""

from __future__ import annotations

import torch

from .._tensors import local

__all__ = ["fused_probe", "Fused"]

_F32 = torch.float32
_SMALL = 1 << 16  # elements: below this a tensor joins the flat copy (measured: see benchmarks/README.md)


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
        if bool(torch.isfinite(self.summary).all()):
            return [False] * len(self.tensors)
        return (~torch.isfinite(_per_tensor(self.tensors))).tolist()


def fused_probe(tensors: list[torch.Tensor]) -> torch.Tensor | Fused:
    """Probe many tensors: a float32 vector (one element per tensor, in order), or on CPU a
    :class:`Fused` whose summary covers them all with far fewer dispatches.

    Elsewhere one fused ``_foreach_norm`` per (device, dtype) already is one launch."""
    if not tensors:
        return torch.zeros(0)
    tensors = [local(t) for t in tensors]  # FSDP2: each rank judges its own shard
    if tensors[0].device.type == "cpu":
        small: list[torch.Tensor] = []
        sums: list[torch.Tensor] = []
        try:
            with torch.no_grad():  # one context for the list, no detach per tensor
                for t in tensors:
                    if t.dtype is _F32:
                        if t.numel() <= _SMALL:
                            small.append(t)
                        else:
                            sums.append(t.sum())
                    else:
                        sums.append((torch.view_as_real(t) if t.is_complex() else t).sum(dtype=_F32))
                if len(small) > 1:
                    sums.append(torch._C._nn.flatten_dense_tensors(small).sum())
                elif small:
                    sums.append(small[0].sum())
                if any(s.device.type != "cpu" for s in sums):
                    raise RuntimeError("several devices")
                return Fused(torch.stack(sums), tensors)
        except RuntimeError:  # tensors on several devices
            pass
    return _per_tensor(tensors)


def _per_tensor(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 vector, one element per tensor, in order."""
    if not tensors:
        return torch.zeros(0)
    tensors = [local(t) for t in tensors]  # FSDP2: each rank judges its own shard
    if tensors[0].device.type == "cpu":
        try:
            with torch.no_grad():
                return torch.stack([
                    t.sum() if t.dtype is _F32 else (torch.view_as_real(t) if t.is_complex() else t).sum(dtype=_F32)
                    for t in tensors
                ])
        except RuntimeError:  # tensors on several devices
            pass
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    with torch.no_grad():
        if len(groups) == 1:
            ts = [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
            return torch.stack(torch._foreach_norm(ts, 2, dtype=_F32))
        dev = tensors[0].device
        out = torch.empty(len(tensors), dtype=_F32, device=dev)
        for (d, _), idx in groups.items():
            ts = [torch.view_as_real(tensors[i]) if tensors[i].is_complex() else tensors[i] for i in idx]
            norms = torch.stack(torch._foreach_norm(ts, 2, dtype=_F32)).to(dev, non_blocking=True)
            out[torch.tensor(idx, device=dev)] = norms
        return out
