"""The hot path: `watch()` / `Hunt`, its hooks, probes, compiled checks, distributed agreement and
history. Nothing here reads a value back to the host except at the step's single sync."""

from .dist import SilentRankError
from .hunt import Hunt, NonFiniteWarning
from .options import Options
from .watch import watch

__all__ = ["watch", "Hunt", "NonFiniteWarning", "SilentRankError", "Options"]
