"""``nanhunt audit CHECKPOINT [--ignore GLOB]...``: list the non-finite tensors of a checkpoint.

Exit status: 0 clean, 3 non-finite tensors found, 2 the file cannot be read or would run code
(refused: nothing in it was executed).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser", "cmd"]

EXIT_FOUND = 3
EXIT_USAGE = 2


def add_parser(sub: Any) -> None:
    a = sub.add_parser("audit", help="list the non-finite tensors of a checkpoint (exit 3 if any)",
                       description="Load CHECKPOINT with torch.load(weights_only=True) (a file that would run "
                       "code is refused, never executed; .safetensors via safetensors) and list every floating "
                       "tensor holding NaN/Inf, except a Lightning checkpoint's callback and loop state. "
                       "Exits 3 if there is any, 0 if clean, 2 if the file cannot be read.")
    a.add_argument("checkpoint", help="a torch.save file or a .safetensors file")
    a.add_argument("--ignore", action="append", default=[], metavar="GLOB",
                   help="key paths (\"['state_dict']['mask']\") or last keys (\"*.mask\") not to judge; repeatable")
    a.set_defaults(func=cmd)


def cmd(ns: argparse.Namespace) -> int:
    from .._locate.audit import AuditRefused, audit
    from .._words import one_line

    try:
        found = audit(ns.checkpoint, ignore=ns.ignore)
    except (OSError, AuditRefused) as e:
        print(f"nanhunt: {one_line(str(e))}", file=sys.stderr)  # (a file name from a folder's listing is data)
        return EXIT_USAGE
    path = one_line(ns.checkpoint)
    if not found:
        print(f"{path}: no NaN/Inf")
        return 0
    print(f"{path}: {len(found)} tensor{'s' if len(found) != 1 else ''} with NaN/Inf")
    for f in found:
        counts = ", ".join(f"{f.counts.get(k, 0)} {k}" for k in ("nan", "+inf", "-inf"))
        idx = "[" + ", ".join(map(str, f.index)) + "]" if f.index is not None else ""
        shape = "(" + ", ".join(map(str, f.shape)) + ("," if len(f.shape) == 1 else "") + ")"
        print(f"  {f.tensor}  {shape} {f.dtype}: {counts}; first {idx} = {f.value}")
    return EXIT_FOUND
