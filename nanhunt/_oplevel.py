"""Op-level origin of a finding, by a second faithful replay under a TorchDispatchMode.

(To be implemented: issue 3.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._log import Top
from ._tree import Path

__all__ = ["OpOrigin", "locate_forward", "locate_backward"]


@dataclass
class OpOrigin:
    op: str  # "aten.exp.default" in forward, "SqrtBackward0" in backward
    source: str | None  # "path/to/file.py:LINE" of the user's code
    chain: list[str] = field(default_factory=list)  # "op @ file.py:LINE", oldest first


def locate_forward(top: Top, names: dict[nn.Module, str], ordinal: int, path: Path) -> OpOrigin | None:
    """The op that created the first non-finite value on the path to the reported element of
    output ``path`` of the ``ordinal``-th watched call within ``top``."""
    return None


def locate_backward(
    top: Top, names: dict[nn.Module, str], grads: list[torch.Tensor | None], params: list[Any],
    ordinal: int, path: Path,
) -> OpOrigin | None:
    """The autograd node that created the first non-finite gradient reported at input ``path`` of
    the ``ordinal``-th watched call, and the forward line that created that node."""
    return None
