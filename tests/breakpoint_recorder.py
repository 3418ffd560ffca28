"""A stand-in debugger for tests: ``PYTHONBREAKPOINT=tests.breakpoint_recorder.record`` keeps the
locals of the frame that called ``breakpoint()`` instead of stopping there."""

from __future__ import annotations

import sys
from typing import Any

CALLS: list[dict[str, Any]] = []


def record(*args: Any, **kwargs: Any) -> None:
    CALLS.append(dict(sys._getframe(1).f_locals))
