"""After a hit only: turn one step's log (a read-only `StepView`) into findings.

`locate` is the one entry point the hot path calls; host reads and replays are allowed here.
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from collections.abc import Iterator

from torch.utils._python_dispatch import _disable_current_modes

from .._finding import Finding
from .._steplog import StepView
from .analyze import analyze
from .bundle import BundleError, replay

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
    context is part of how the call ran."""
    state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        with _disable_current_modes():
            yield
    finally:
        random.setstate(state)
        if np is not None and np_state is not None:
            np.random.set_state(np_state)
