"""After a hit only: turn one step's log (a read-only `StepView`) into findings.

`locate` is the one entry point the hot path calls; host reads and replays are allowed here.
"""

from __future__ import annotations

import warnings

from .._finding import Finding
from .._steplog import StepView
from .analyze import analyze
from .bundle import BundleError, replay

__all__ = ["locate", "replay", "BundleError"]


def locate(view: StepView) -> list[Finding]:
    """`analyze` with the warnings of its replays and reads kept from the user: a replay re-runs
    the user's code (which warned once already) and torch remarks on nanhunt's own reads; only
    nanhunt's own warnings (a bundle that could not be written) get through."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("default", message="nanhunt")
        return analyze(view)
