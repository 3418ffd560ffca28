"""Checks inside `torch.compile` graphs: a branch-free write into a device buffer.

Inside a compiled graph the module hooks are traced. A data-dependent branch or a Python list
append there would break the graph, so each (module, output path) gets a slot of a device buffer,
assigned at trace time, and the traced hook only adds the output's probe sum into it. The step's
sync reads the buffer with everything else.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .._steplog import CompiledSlots
from .._tensors import is_checked, probe, tensors

__all__ = ["CompiledChecks", "forget_compiled"]

SLOTS = 4096  # (module, output) pairs checked inside compiled graphs


class CompiledChecks:
    def __init__(self, device: torch.device | str) -> None:
        self.buf = torch.zeros(SLOTS, device=device)
        self.slots: dict[tuple[str, Any], int] = {}
        self.meta: list[tuple[str, str, Any]] = []  # per slot: module name, class name, output path

    def record(self, name: str, module_type: str, output: Any) -> None:
        buf = self.buf
        for path, t in tensors(output):
            if not is_checked(t) or t.device != buf.device:
                continue
            slot = self.slots.get((name, path))
            if slot is None:
                if len(self.slots) >= buf.numel():
                    continue
                slot = self.slots[(name, path)] = len(self.slots)
                self.meta.append((name, module_type, path))
            with torch.no_grad():
                buf[slot].add_(probe(t))

    def drain(self) -> tuple[torch.Tensor, CompiledSlots] | None:
        """This step's slots (for the sync), and a zeroed buffer for the next step. No host read."""
        if not self.slots:
            return None
        values = self.buf[: len(self.slots)].clone()
        self.buf.zero_()
        return values, CompiledSlots(list(self.meta))


def forget_compiled() -> None:
    """Make torch.compile retrace: graphs compiled without (or with) our hooks must not run on."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return
    from torch._dynamo.utils import counters

    if counters["stats"]["unique_graphs"]:
        dynamo.reset()
