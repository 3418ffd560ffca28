"""Command line: `nanhunt run|demo|show|replay`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("nanhunt: command line coming", file=sys.stderr)
    return 2
