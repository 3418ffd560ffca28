"""nanhunt: find the first NaN/Inf in a PyTorch run, and where it was born."""

import logging as _logging

from ._finding import Finding, NonFiniteError
from ._locate import replay
from ._record import Hunt, NonFiniteWarning, watch
from ._report import Report

__all__ = ["watch", "Hunt", "Finding", "Report", "NonFiniteError", "NonFiniteWarning", "replay", "__version__"]
__version__ = "0.1.0"

# nanhunt logs through the "nanhunt" logger and never prints; silent until the application configures logging
_logging.getLogger("nanhunt").addHandler(_logging.NullHandler())
