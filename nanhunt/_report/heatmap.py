"""The HTML report's heatmap: per-module abs-max over the last recorded steps, as inline SVG.

Rows are modules in the model's order (a parent right above its children), columns are the
sampled steps. The finding's module always has a row and the finding's cell is always drawn:
filled as non-finite and outlined, even when its step was not a sampled one (an extra column,
where the other modules were not measured) or its module was never sampled (a row added for it).
"""

from __future__ import annotations

import html as _html
import math
from typing import Any

from .._words import fmt as _fmt
from .._words import num as _num
from .._words import one_line, visible

__all__ = ["heatmap_svg", "tree_order"]

_MAX_COLS, _MAX_ROWS = 64, 120
_PLOT_W = 720  # the cells' total width to aim for, px
_CELL_H, _MIN_CELL_W, _MAX_CELL_W = 20, 12, 56
_FONT, _CHAR_W = 12, 7.3  # monospace label size and the width of one of its characters, px
_FINDING, _BAD, _EMPTY = "#00b3ff", "#111111", "#eceff3"
_STOPS = [(255, 247, 188), (254, 196, 79), (236, 112, 20), (189, 0, 38), (90, 0, 40)]


def _colour(v: float | None, lo: float, hi: float) -> str:
    """Light yellow (small) to dark red (large) on a log scale; non-finite black, unmeasured grey."""
    if v is None:
        return _EMPTY
    if not math.isfinite(v):
        return _BAD
    x = math.log10(abs(v)) if v != 0 else lo
    t = 0.0 if hi <= lo else min(1.0, max(0.0, (x - lo) / (hi - lo)))
    seg = min(int(t * (len(_STOPS) - 1)), len(_STOPS) - 2)
    u = t * (len(_STOPS) - 1) - seg
    a, b = _STOPS[seg], _STOPS[seg + 1]
    return "#" + "".join(f"{round(a[i] + (b[i] - a[i]) * u):02x}" for i in range(3))


def _matrix(history: dict[str, Any], key: str, n_rows: int, n_cols: int) -> list[list[float | None]]:
    raw = history.get(key)
    out: list[list[float | None]] = []
    for r in range(n_rows):
        row = raw[r] if isinstance(raw, list) and r < len(raw) and isinstance(raw[r], list) else []
        out.append([_num(row[c]) if c < len(row) else None for c in range(n_cols)])
    return out


def tree_order(names: list[str]) -> list[int]:
    """Indices of ``names`` (qualified module names) in pre-order: each parent right above its
    children, siblings in the order they first appear (the history lists them in call-return order)."""
    first: dict[str, int] = {}
    for i, n in enumerate(names):
        parts = n.split(".") if n else []
        for k in range(len(parts) + 1):
            first.setdefault(".".join(parts[:k]), i)
    index = {n: i for i, n in enumerate(names)}

    def key(n: str) -> tuple[int, ...]:
        parts = n.split(".") if n else []
        return tuple(first[".".join(parts[:k])] for k in range(1, len(parts) + 1))

    return [index[n] for n in sorted(index, key=key)]


def heatmap_svg(history: dict[str, Any], mark: tuple[str, int] | None = None, value: Any = None) -> str:
    """An inline SVG heatmap of per-module abs-max (rows: modules, columns: steps); ``""`` if no data.

    ``mark`` is the finding's ``(module, step)`` and ``value`` its value: that cell is drawn
    non-finite and outlined, and its row and column labels are red.
    """
    if not isinstance(history, dict):
        return ""
    steps = [s for s in history.get("steps") or [] if isinstance(s, int) and not isinstance(s, bool)]
    modules = [str(m) for m in history.get("modules") or []]
    if not steps or not modules:
        return ""
    absmax = _matrix(history, "absmax", len(modules), len(steps))
    rms = _matrix(history, "rms", len(modules), len(steps))
    zeros = _matrix(history, "zeros", len(modules), len(steps))
    headroom = _matrix(history, "headroom", len(modules), len(steps))
    raw_dtypes = history.get("dtype")
    dtypes: dict[str, Any] = raw_dtypes if isinstance(raw_dtypes, dict) else {}
    mod, at = (str(mark[0]), mark[1]) if mark is not None else (None, None)
    if mod is not None and mod not in modules:  # never sampled (e.g. made no output of its own): a row for it
        modules.append(mod)
        for m in (absmax, rms, zeros, headroom):
            m.append([None] * len(steps))

    c0 = max(0, len(steps) - _MAX_COLS)
    cols: list[int | None] = list(range(c0, len(steps)))  # a history index per column; None: not sampled
    col_steps = steps[c0:]
    if at is not None and at not in col_steps:  # the finding's step was not a sampled one: a column for it
        j = sum(1 for s in col_steps if s < at)
        cols.insert(j, None)
        col_steps = [*col_steps[:j], at, *col_steps[j:]]
    n_cols = len(cols)
    mcol = col_steps.index(at) if at is not None else None
    order = tree_order(modules)
    if len(order) > _MAX_ROWS:  # keep the marked module visible
        keep = order[:_MAX_ROWS]
        if mod is not None and modules.index(mod) not in keep:
            keep[-1] = modules.index(mod)
        order = keep
    mrow = order.index(modules.index(mod)) if mod is not None and modules.index(mod) in order else None

    finite = [abs(v) for r in order for v in absmax[r][c0:] if v is not None and math.isfinite(v) and v != 0]
    lo = math.log10(min(finite)) if finite else 0.0
    hi = math.log10(max(finite)) if finite else 1.0

    cw = max(_MIN_CELL_W, min(_MAX_CELL_W, _PLOT_W // max(1, n_cols)))
    names = [one_line(modules[r] or "<model>") for r in order]  # a name's control characters shown escaped
    label_w = int(min(380, 16 + _CHAR_W * max(len(n) for n in names)))
    top = 40
    plot_w = n_cols * cw
    legend_w = 640
    width = int(max(label_w + plot_w + 16, label_w + legend_w))
    height = top + len(order) * _CELL_H + 86

    def e(s: str) -> str:  # markup escaped, and control characters and bidi overrides shown escaped
        return _html.escape(visible(s))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="per-module abs-max heatmap" font-size="{_FONT}">'
    ]
    # column labels: as many as fit without overlapping
    widest = _CHAR_W * max(len(str(s)) for s in col_steps) + 6
    every = max(1, math.ceil(widest / cw))
    for j, s in enumerate(col_steps):
        if j % every and j != mcol:
            continue
        if j != mcol and mcol is not None and abs(j - mcol) * cw < widest:
            continue  # the finding's step label wins
        x = label_w + j * cw + cw / 2
        style = ' fill="#d93025" font-weight="bold"' if j == mcol else ' fill="#445"'
        out.append(f'<text x="{x:.0f}" y="{top - 8}" text-anchor="middle"{style}>{s}</text>')
    out.append(f'<text x="{label_w}" y="14" fill="#445">training step →</text>')
    for i, r in enumerate(order):
        y = top + i * _CELL_H
        name = names[i]
        max_chars = int((label_w - 14) / _CHAR_W)
        short = name if len(name) <= max_chars else "…" + name[-(max_chars - 1):]
        style = ' fill="#d93025" font-weight="bold"' if i == mrow else ' fill="#223"'
        out.append(f'<text x="{label_w - 8}" y="{y + _CELL_H - 6}" text-anchor="end"{style}>'
                   f'<title>{e(name)}</title>{e(short)}</text>')
        for j, c in enumerate(cols):
            v = absmax[r][c] if c is not None else None
            marked = i == mrow and j == mcol
            if marked:
                fv = _num(value)
                v = fv if fv is not None and not math.isfinite(fv) else math.nan
            tip = [f"{name} @ step {col_steps[j]}", f"abs-max {_fmt(v)}"]
            if marked:
                tip.append("the finding")
            elif c is not None:
                tip.append(f"rms {_fmt(rms[r][c])}, zeros {_fmt(zeros[r][c])}, headroom {_fmt(headroom[r][c])}")
                if dtypes.get(modules[r]):
                    tip.append(str(dtypes[modules[r]]))
            else:
                tip.append("not measured (not a sampled step)")
            out.append(f'<rect x="{label_w + j * cw}" y="{y}" width="{cw - 1}" height="{_CELL_H - 1}" '
                       f'fill="{_colour(v, lo, hi)}"><title>{e(" · ".join(tip))}</title></rect>')
    if mrow is not None and mcol is not None:
        out.append(f'<rect class="finding" x="{label_w + mcol * cw - 2}" y="{top + mrow * _CELL_H - 2}" '
                   f'width="{cw + 3}" height="{_CELL_H + 3}" fill="none" stroke="{_FINDING}" stroke-width="3"/>')
    # legend: a colour bar with its two ends under it, then the three swatches, each sized to its text
    ly = top + len(order) * _CELL_H + 22
    bar = 220
    for k in range(44):
        v = 10 ** (lo + (hi - lo) * k / 43)
        out.append(f'<rect x="{label_w + k * bar / 44:.1f}" y="{ly}" width="{bar / 44 + 0.6:.1f}" height="12" '
                   f'fill="{_colour(v, lo, hi)}"/>')
    out.append(f'<text x="{label_w}" y="{ly + 28}" fill="#445">{_fmt(10 ** lo)}</text>')
    out.append(f'<text x="{label_w + bar}" y="{ly + 28}" text-anchor="end" fill="#445">{_fmt(10 ** hi)}</text>')
    out.append(f'<text x="{label_w - 8}" y="{ly + 11}" text-anchor="end" fill="#778">abs-max (log)</text>')
    x = label_w + bar + 28
    for fill, stroke, label in ((_BAD, "", "nan/inf"), (_EMPTY, "", "not measured"), ("none", _FINDING, "finding")):
        extra_attr = f' stroke="{stroke}" stroke-width="3"' if stroke else ""
        out.append(f'<rect x="{x}" y="{ly}" width="14" height="12" fill="{fill}"{extra_attr}/>')
        out.append(f'<text x="{x + 20}" y="{ly + 11}" fill="#445">{label}</text>')
        x += 20 + int(_CHAR_W * len(label)) + 22
    out.append("</svg>")
    return "".join(out)
