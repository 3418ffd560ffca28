"""`Report.to_tensorboard(writer)`: the report in TensorBoard, next to the run's own curves.

Any writer with ``add_scalar(tag, value, step)`` and ``add_text(tag, text, step)`` works
(``torch.utils.tensorboard.SummaryWriter``, which needs ``pip install tensorboard``; tensorboardX):
nothing here imports it. Written: per module, the sampled abs-max and RMS of its output at each
recorded step (``nanhunt/absmax/<module>``, ``nanhunt/rms/<module>``); the finding's value at its
step on its module's abs-max curve; the report's text at the first finding's step
(``nanhunt/report``) and each finding's summary (``nanhunt/findings``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .._words import num

if TYPE_CHECKING:
    from .report import Report

__all__ = ["to_tensorboard"]


def to_tensorboard(report: Report, writer: Any, prefix: str = "nanhunt") -> int:
    """Write the report through ``writer``; returns how many values were written."""
    for name in ("add_scalar", "add_text"):
        if not callable(getattr(writer, name, None)):
            raise TypeError(f"to_tensorboard() needs a SummaryWriter (with .{name}); got {type(writer).__name__}")
    n = 0
    hist = report.history if isinstance(report.history, dict) else {}
    steps = [s for s in hist.get("steps") or [] if isinstance(s, int)]
    modules = [str(m) for m in hist.get("modules") or []]
    for key in ("absmax", "rms"):
        rows = hist.get(key)
        if not isinstance(rows, list):
            continue
        for name, row in zip(modules, rows):
            if not isinstance(row, list):
                continue
            for step, v in zip(steps, row):
                x = num(v)
                if x is not None:
                    writer.add_scalar(f"{prefix}/{key}/{name or '<model>'}", x, step)
                    n += 1
    f = report.first
    if f is not None:
        v = num(f.value)
        if v is not None and not math.isfinite(v) and f.phase != "check":
            writer.add_scalar(f"{prefix}/absmax/{f.module or '<model>'}", abs(v), f.step)
            n += 1
        # TensorBoard renders text as Markdown: an indented block keeps the report's columns
        writer.add_text(f"{prefix}/report", "\n".join("    " + line for line in report.to_text().splitlines()), f.step)
        n += 1
        for g in report.findings:
            writer.add_text(f"{prefix}/findings", g.summary(), g.step)
            n += 1
    return n
