"""After a hit: which persistent state holds non-finite values (`Report.damage`).

Read once, when the first finding's step has ended (after nanhunt put buffers back or dropped a
skipped step's gradients): all empty means the NaN was contained in that step's activations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .checkpoint import all_bad

__all__ = ["damage", "bad_state", "KINDS", "empty"]

KINDS = ("grads", "parameters", "buffers", "optimizer_state")


def empty() -> dict[str, list[str]]:
    return {k: [] for k in KINDS}


def damage(root: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, list[str]]:
    """Qualified names of the non-finite gradients, parameters, buffers and optimizer state
    (``"<parameter>.<state key>"``, e.g. ``"fc.weight.exp_avg"``)."""
    out = empty()
    if root is None:
        return out
    params: list[tuple[str, torch.Tensor]] = list(root.named_parameters())
    names = {id(p): n for n, p in params}
    params += _optimizers_own(optimizers, names)
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {
        "grads": [(n, p.grad) for n, p in params if p.grad is not None],
        "parameters": [(n, p) for n, p in params],
        "buffers": list(root.named_buffers()),
        "optimizer_state": [],
    }
    for opt in optimizers:
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                pname = names.get(id(p), f"param_groups[{gi}][{pi}]")
                for k, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        groups["optimizer_state"].append((f"{pname}.{k}", v))
    for kind, items in groups.items():
        if items:
            out[kind] = [items[i][0] for i in all_bad([t for _, t in items])]
    return out


def bad_state(root: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The parameters, buffers and optimizer state tensors that hold non-finite values now."""
    ts = [*(root.parameters() if root is not None else ()), *(root.buffers() if root is not None else ())]
    ts += [p for _, p in _optimizers_own(optimizers, {id(t): "" for t in ts})]
    ts += [v for o in optimizers for st in o.state.values() for v in st.values()
           if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())]
    ts = [t for t in ts if t.is_floating_point() or t.is_complex()]
    return [ts[i] for i in all_bad(ts)]


def _optimizers_own(optimizers: Sequence[torch.optim.Optimizer], names: dict[int, str]) -> list[tuple[str, torch.Tensor]]:
    """The optimizers' parameters that are not the model's (a loss's learned temperature in a group
    of its own), named as in the optimizer: ``"param_groups[1][0]"``. They are persistent state too."""
    out: list[tuple[str, torch.Tensor]] = []
    seen = set(names)
    for opt in optimizers:
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"param_groups[{gi}][{pi}]", p))
    return out
