"""Device-side probes: one small tensor per checked tensor, non-finite iff the tensor has a
non-finite element (or, rarely, its finite values overflow the sum: every hit is re-checked
exactly before it becomes a finding). No probe reads anything back to the host."""

from __future__ import annotations

import torch

__all__ = ["probe", "fused_probe", "is_checked", "version"]

_F32 = torch.float32


def version(t: torch.Tensor) -> int:
    """``t._version``; -1 for inference tensors (``torch.inference_mode``), which have no counter."""
    return -1 if t.is_inference() else t._version


def is_checked(t: torch.Tensor) -> bool:
    """Only floating and complex tensors can hold NaN/Inf."""
    return t.is_floating_point() or t.is_complex()


def probe(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim float32 tensor on ``t``'s device, outside autograd."""
    t = t.detach()  # cheaper than a no_grad context per call
    if t.dtype is _F32:
        return t.sum()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.sum(dtype=_F32)


def fused_probe(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 vector, one element per tensor, in order.

    On CPU a plain sum per tensor is the cheapest (measured: 1.6 ms for GPT-2's 12M gradient
    values vs 3.1 ms for ``_foreach_norm``); elsewhere one fused ``_foreach_norm`` per
    (device, dtype) saves the kernel launches.
    """
    if not tensors:
        return torch.zeros(0)
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
