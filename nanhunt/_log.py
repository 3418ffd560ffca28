"""What the hooks record during one step: device-side sums and the metadata to decode them.

Nothing here reads a value from the device. The step's single sync happens in
:meth:`StepLog.any_bad`, called by the hunt when the step ends.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._tree import Path

__all__ = ["Call", "Top", "TensorInfo", "StepLog", "Entry"]


class Call:
    """One call of one watched module during the step."""

    __slots__ = (
        "module", "name", "call", "depth", "parent", "top", "ordinal", "index",
        "paths", "outs", "in_keys", "out_keys",
    )

    def __init__(self, module: nn.Module, name: str, call: int, depth: int, parent: int, top: int, ordinal: int):
        self.module = module
        self.name = name
        self.call = call
        self.depth = depth
        self.parent = parent  # index of the enclosing Call in StepLog.calls, -1 at top level
        self.top = top  # index into StepLog.tops
        self.ordinal = ordinal  # watched-module calls since its top-level call began
        self.index = -1  # this call's index in StepLog.calls
        self.paths: list[Path] = []
        self.outs: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self.in_keys: list[tuple[int, Path]] = []
        self.out_keys: list[tuple[int, Path]] = []


class Top:
    """A top-level call of a watched module: enough to replay it faithfully."""

    __slots__ = (
        "module", "args", "kwargs", "versions", "rng", "cuda_rng", "autocast", "grad_enabled",
        "out_keys", "calls",
    )

    def __init__(self, module: nn.Module, args: tuple[Any, ...], rng: torch.Tensor,
                 cuda_rng: list[torch.Tensor] | None, autocast: tuple[Any, ...], grad_enabled: bool):
        self.module = module
        self.args = args
        self.kwargs: dict[str, Any] | None = None
        self.versions: list[int] = []
        self.rng = rng
        self.cuda_rng = cuda_rng
        self.autocast = autocast
        self.grad_enabled = grad_enabled
        self.out_keys: list[int] = []
        self.calls = 0


@dataclass
class TensorInfo:
    """A tensor that got a gradient hook: who made it and who used it."""

    producers: list[tuple[int, Path]] = field(default_factory=list)  # (call index, output path)
    consumers: list[tuple[int, Path]] = field(default_factory=list)  # (call index, input path)
    grad: torch.Tensor | None = None  # kept only for gradients arriving at a top-level output
    keep_grad: bool = False
    ref: Any = None


# An entry's meta: ("fwd", call_index, output_number) | ("chk", name, tensor)
#                  | ("bwd", tensor_key, pass_number)
Entry = tuple[Any, ...]


class StepLog:
    """Everything recorded since the last sync."""

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] = []
        self.meta: list[Entry] = []
        self.vectors: list[tuple[torch.Tensor, Entry]] = []  # fused checks (grads, params, state)
        self.calls: list[Call] = []
        self.tops: list[Top] = []
        self.tensors: list[TensorInfo] = []
        self.keys: dict[tuple[int, int], int] = {}
        self.handles: list[Any] = []
        self.counts: dict[nn.Module, int] = {}
        self.ignored: set[tuple[int, int]] = set()
        self.probed: dict[tuple[int, int], Any] = {}  # (id, version) -> weakref: probed this step
        self.stats: list[torch.Tensor] = []  # sampled steps only: see _history
        self.stats_rows: list[tuple[str, str, int]] = []
        self.root_calls = 0

    def __len__(self) -> int:
        return len(self.sums) + len(self.vectors)

    def bad_flag(self) -> torch.Tensor | None:
        """A device-side 0-dim bool: is any recorded value non-finite? No host read here."""
        parts = []
        if self.sums:
            parts.append(torch.isfinite(_stack(self.sums)).all())
        for v, _ in self.vectors:
            parts.append(torch.isfinite(v).all())
        if not parts:
            return None
        if len(parts) == 1:
            return ~parts[0]
        dev = parts[0].device
        return ~torch.stack([p.to(dev, non_blocking=True) for p in parts]).all()

    def bad_flags(self) -> tuple[list[bool], list[list[bool]]]:
        """After a hit: which entries are non-finite (more syncs, allowed now)."""
        s = (~torch.isfinite(_stack(self.sums))).tolist() if self.sums else []
        v = [(~torch.isfinite(t)).tolist() for t, _ in self.vectors]
        return s, v

    def release(self) -> None:
        """Drop every reference and remove every tensor hook of the step."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.sums.clear()
        self.meta.clear()
        self.vectors.clear()
        self.calls.clear()
        self.tops.clear()
        self.tensors.clear()
        self.keys.clear()
        self.counts.clear()
        self.ignored.clear()
        self.probed.clear()
        self.stats.clear()
        self.stats_rows.clear()


def _stack(ts: list[torch.Tensor]) -> torch.Tensor:
    """Stack 0-dim probes; probes on several devices (model parallel) meet on the first one."""
    try:
        return torch.stack(ts)
    except RuntimeError:
        dev = ts[0].device
        return torch.stack([t.to(dev) for t in ts])
