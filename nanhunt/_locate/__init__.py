"""After a hit only: turn one step's log (a read-only `StepView`) into findings.

`locate` is the one entry point the hot path calls; host reads and replays are allowed here.
"""

from .analyze import analyze as locate
from .bundle import BundleError, replay

__all__ = ["locate", "replay", "BundleError"]
