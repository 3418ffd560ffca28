"""Internal faults: nanhunt's own code must never break the run it watches.

Every hook stage (module pre/post hooks, gradient hooks, optimizer step hooks, the step's end)
runs its body under ``try``/``except`` (free in Python 3.11 when nothing raises). An exception
there that is not nanhunt doing its job (a `NonFiniteError` in raise mode, or an exception
raised by the user's own ``on_find`` callable) is an internal fault: it is logged once through
``logging.getLogger("nanhunt")`` and the hunt switches itself off (every hook removed, every
reference dropped), so the run goes on exactly as it would unwatched. With ``on_find="raise"``
the fault surfaces as :class:`InternalError`, never as a finding.
"""

from __future__ import annotations

import logging

__all__ = ["InternalError", "log_fault"]

_log = logging.getLogger("nanhunt")


class InternalError(RuntimeError):
    """A bug inside nanhunt (not a finding): the hunt switched itself off."""


def log_fault(stage: str, exc: BaseException) -> str:
    """Log an internal fault once (the hunt is off after it); returns the one-line message."""
    msg = (f"nanhunt internal error in {stage}: {type(exc).__name__}: {exc}. The hunt switched itself "
           "off; the run continues unwatched (please report this with the traceback).")
    _log.error(msg, exc_info=(type(exc), exc, exc.__traceback__))
    return msg
