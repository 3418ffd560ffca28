"""nanhunt: find the first NaN/Inf in a PyTorch run, and where it was born."""

from ._finding import Finding, NonFiniteError
from ._locate import replay
from ._locate.audit import audit
from ._record import Hunt, NonFiniteWarning, watch
from ._report import Report

__all__ = ["watch", "Hunt", "Finding", "Report", "NonFiniteError", "NonFiniteWarning", "replay", "audit", "__version__"]
__version__ = "0.1.0"
