"""nanhunt: find the first NaN/Inf in a PyTorch run, and where it was born.

The public names are imported on first use (PEP 562), so that importing a part of nanhunt that
needs no torch — the pytest plugin, which pytest loads in every run where nanhunt is installed —
costs nothing: ``import nanhunt`` alone does not import torch.
"""

import importlib as _importlib
import logging as _logging
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

if _TYPE_CHECKING:
    from ._finding import Finding, NonFiniteError
    from ._locate import replay
    from ._locate.audit import audit
    from ._record import Hunt, NonFiniteWarning, SilentRankError, watch
    from ._report import Report

__all__ = ["watch", "Hunt", "Finding", "Report", "NonFiniteError", "NonFiniteWarning", "SilentRankError", "replay",
           "audit", "__version__"]
__version__ = "0.1.0"

# nanhunt logs through the "nanhunt" logger and never prints; silent until the application configures logging
_logging.getLogger("nanhunt").addHandler(_logging.NullHandler())

_WHERE = {
    "watch": "._record", "Hunt": "._record", "NonFiniteWarning": "._record", "SilentRankError": "._record",
    "Finding": "._finding", "NonFiniteError": "._finding",
    "Report": "._report",
    "replay": "._locate", "audit": "._locate.audit",
}


def __getattr__(name: str) -> _Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'nanhunt' has no attribute {name!r}")
    value = getattr(_importlib.import_module(where, __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
