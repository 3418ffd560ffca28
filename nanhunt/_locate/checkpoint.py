"""Checkpoints as data: every tensor of a saved object with its key path, and the finding for one
non-finite tensor (imports only the leaves).

Shared by the save guard (`_record/guard.py`), `audit` (`audit.py`) and `damage` (`damage.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .._finding import Finding
from .._tensors import dtype_name, element, is_bad, is_checked, probe, stack_probes

__all__ = ["Keys", "Entry", "walk", "key_path", "first_bad", "all_bad", "finding"]

Keys = tuple[Any, ...]
# (key path, tensor, inside the "state" of something shaped like an optimizer's state_dict)
Entry = tuple[Keys, torch.Tensor, bool]

_MAX_DEPTH = 64


def key_path(keys: Keys) -> str:
    """``['model']['fc.weight']``: how a person indexes the saved object; a bare tensor is ``<tensor>``."""
    return "".join(f"[{k!r}]" for k in keys) or "<tensor>"


def _is_optimizer_state(d: Mapping[Any, Any]) -> bool:
    return isinstance(d.get("state"), Mapping) and isinstance(d.get("param_groups"), (list, tuple))


def walk(obj: Any) -> Iterator[Entry]:
    """Every tensor of ``obj`` (dicts, lists, tuples; a module or optimizer as its state_dict), in
    a stable order; each container is visited once (no cycles)."""
    seen: set[int] = set()

    def go(o: Any, keys: Keys, optim: bool, depth: int) -> Iterator[Entry]:
        if isinstance(o, torch.Tensor):
            yield keys, o, optim
            return
        if depth >= _MAX_DEPTH or o is None or isinstance(o, (str, bytes, int, float, bool)):
            return
        if isinstance(o, (nn.Module, torch.optim.Optimizer)):
            o = o.state_dict()
        if id(o) in seen:
            return
        if isinstance(o, Mapping):
            seen.add(id(o))
            opt_sd = _is_optimizer_state(o)
            for k, v in o.items():
                yield from go(v, (*keys, k), optim or (opt_sd and k == "state"), depth + 1)
        elif isinstance(o, (list, tuple)):
            seen.add(id(o))
            for i, v in enumerate(o):
                yield from go(v, (*keys, i), optim, depth + 1)

    yield from go(obj, (), False, 0)


def _judgeable(t: torch.Tensor) -> bool:
    return is_checked(t) and t.layout is torch.strided and not t.is_meta and t.numel() > 0


def all_bad(ts: list[torch.Tensor]) -> list[int]:
    """Indices of the non-finite tensors: one fused probe and one read, then exact checks of the hits."""
    idx = [i for i, t in enumerate(ts) if _judgeable(t)]
    if not idx:
        return []
    with torch.no_grad():
        flags = (~torch.isfinite(stack_probes([probe(ts[i]) for i in idx]))).tolist()
    return [i for i, f in zip(idx, flags) if f and is_bad(ts[i])]


def first_bad(ts: list[torch.Tensor]) -> int | None:
    bad = all_bad(ts)
    return bad[0] if bad else None


def finding(file: str, keys: Keys, t: torch.Tensor, *, step: int, hint: str, rank: int | None = None) -> Finding:
    """A ``"checkpoint"`` finding: ``module`` the file, ``tensor`` the key path."""
    index, value, counts = element(t)
    return Finding(
        phase="checkpoint", module=file, module_type="checkpoint", tensor=key_path(keys), step=step,
        call=0, index=index, value=value, counts=counts, shape=tuple(t.shape), dtype=dtype_name(t),
        cause="unknown", rank=rank, hint=hint,
    )
