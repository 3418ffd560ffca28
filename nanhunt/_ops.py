"""``mode="ops"``: every aten op checked from the start, for users who accept the cost.

A `TorchDispatchMode` kept on for the whole watch probes each floating output of each op (forward
and backward) into the step's log, the same device-side way the module hooks do. On a hit the
first non-finite op is known even when a replay cannot reproduce the step; in backward it is the
autograd node that ran it. Costs a probe per op (see the benchmark): a debugging setting.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ._probe import is_checked, probe

if TYPE_CHECKING:
    from ._hunt import Hunt

__all__ = ["OpsMode", "quietly"]

_SKIP = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default, torch.ops.aten.alias.default}


class OpsMode(TorchDispatchMode):
    def __init__(self, hunt: Hunt) -> None:
        super().__init__()
        self.hunt = hunt

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        h = self.hunt
        if h._quiet or h._paused or h._closed or func in _SKIP:
            return out
        log = h._log
        backward = torch._C._current_graph_task_id() != -1
        node = type(torch._C._current_autograd_node()).__name__ if backward else None
        ci = h._stack[-1].index if h._stack and not backward else -1
        for j, t in enumerate(tree_leaves(out)):
            if isinstance(t, torch.Tensor) and is_checked(t) and t.numel():
                log.sums.append(probe(t))
                log.meta.append(("op", str(func), node, ci, j))
        return out


def quietly(hunt: Hunt, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run one of the hunt's own methods without its tensor ops being recorded as the user's."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        hunt._quiet += 1
        try:
            return fn(*args, **kwargs)
        finally:
            hunt._quiet -= 1

    return run
