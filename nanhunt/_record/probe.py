"""Fused device-side probes for many tensors at once (gradients, parameters, optimizer state).

One small tensor per checked tensor, non-finite iff the tensor has a non-finite element (single
tensors: ``_tensors.probe``). No probe reads anything back to the host."""

from __future__ import annotations

import torch

from .._tensors import local

__all__ = ["fused_probe"]

_F32 = torch.float32


def fused_probe(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 vector, one element per tensor, in order.

    On CPU a plain sum per tensor is the cheapest (measured: 1.6 ms for GPT-2's 12M gradient
    values vs 3.1 ms for ``_foreach_norm``); elsewhere one fused ``_foreach_norm`` per
    (device, dtype) saves the kernel launches.
    """
    if not tensors:
        return torch.zeros(0)
    tensors = [local(t) for t in tensors]  # FSDP2: each rank judges its own shard
    if tensors[0].device.type == "cpu":
        try:
            with torch.no_grad():  # one context for the list, no detach per tensor
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
