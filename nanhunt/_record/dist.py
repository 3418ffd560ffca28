"""torch.distributed: one collective folded into the step's sync, and every rank's findings on a hit."""

from __future__ import annotations

from typing import Any

import torch

from .._finding import Finding

__all__ = ["group", "rank", "all_ranks_max", "gather_findings"]


def group() -> Any:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def all_ranks_max(flag: torch.Tensor) -> bool:
    """OR of every rank's flag: one all_reduce, then the step's one host read."""
    dist = torch.distributed
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = flag.to(device=dev, dtype=torch.int32).reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0])


def gather_findings(found: list[Finding], rank: int | None) -> list[Finding]:
    """After a hit on some rank: every rank gets every rank's findings of this step."""
    dist = torch.distributed
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [f.to_dict() for f in found])
    own = list(found)
    others = [Finding.from_dict(d) for r, fs in enumerate(everyone) if r != rank for d in (fs or [])]
    return own + others


def rank() -> int | None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None
