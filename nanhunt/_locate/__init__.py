"""After a hit only: turn one step's log (a read-only `StepView`) into findings.

`locate` is the one entry point the hot path calls; host reads and replays are allowed here.
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .._finding import Finding
from .._steplog import StepView
from .analyze import analyze
from .bundle import BundleError, replay
from .replay import CollectiveRefused

__all__ = ["locate", "replay", "BundleError"]


def locate(view: StepView) -> list[Finding]:
    """`analyze` with the warnings of its replays and reads kept from the user: a replay re-runs
    the user's code (which warned once already) and torch remarks on nanhunt's own reads; only
    nanhunt's own warnings (a bundle that could not be written) get through. The replays leave
    the user's other state alone too (`_aside`)."""
    with warnings.catch_warnings(), _aside():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("default", message="nanhunt")
        return analyze(view)


@contextlib.contextmanager
def _aside() -> Iterator[None]:
    """What the replays would change besides torch's RNG (which `replay.faithful` restores): the
    user's Python and NumPy random streams (a forward that draws from ``random``: LayerDrop), and
    the user's dispatch modes on the stack at the sync (a ``FlopCounterMode`` or a ``DebugMode``
    around the step would count the replays' ops). Function modes stay: a ``torch.device``
    context is part of how the call ran. Under torch.distributed the replays run on this rank
    alone: a collective in them (a tensor-parallel layer's all_reduce, SyncBatchNorm's all_gather)
    fails at once (`_NoCollectives`) instead of waiting for ranks that never join it, or pairing
    with another rank's unrelated one; that replay is left out."""
    state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        with _disable_current_modes(), (_NoCollectives() if _ranks() > 1 else contextlib.nullcontext()):
            yield
    finally:
        random.setstate(state)
        if np is not None and np_state is not None:
            np.random.set_state(np_state)


def _ranks() -> int:
    d = torch.distributed
    return int(d.get_world_size()) if d.is_available() and d.is_initialized() else 1


class _NoCollectives(TorchDispatchMode):
    """A collective (``c10d``, functional collectives) raises instead of running."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # (a compiled replay keeps its compiled artifact)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            raise CollectiveRefused(str(func))
        return func(*args, **(kwargs or {}))
