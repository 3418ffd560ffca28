"""The text of the source lines a report names (``Finding.source`` and each step of the road), read
when the report is made, where the files are, and kept in the report: a report opened later or
elsewhere still shows the lines."""

from __future__ import annotations

import linecache
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._finding import Finding

__all__ = ["read_sources", "road_location"]

_MAX_LINE = 240  # a generated one-line file should not fill the report


def road_location(step: str) -> str | None:
    """``"file.py:LINE"`` of one road step ``"op @ file.py:LINE"``; None when it has none."""
    op, sep, where = step.rpartition(" @ ")
    return where if sep and op else None


def read_sources(findings: Iterable[Finding]) -> dict[str, str]:
    """``{"path/file.py:LINE": "the line, stripped"}`` for every location the findings name."""
    out: dict[str, str] = {}
    for f in findings:
        for loc in (f.source, *(road_location(c) for c in f.chain)):
            if not loc or loc in out:
                continue
            path, _, line = loc.rpartition(":")
            if path and line.isdigit():
                text = linecache.getline(path, int(line)).strip()
                if text:
                    out[loc] = text if len(text) <= _MAX_LINE else text[: _MAX_LINE - 1] + "…"
    return out
