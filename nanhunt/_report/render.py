"""Renderers for a `Report`: terminal text, `rich` renderables, and a self-contained HTML page.

- :func:`text` — plain text; the first line is the one-sentence answer, then a small table.
- :func:`rich_renderables` — the same with colour and tables, used by ``Report.__rich_console__``
  (``rich`` is imported only there; install it with ``pip install 'nanhunt[rich]'``).
- :func:`html` — one page with inline CSS and SVG only (no network fetch, no script): the answer,
  a heatmap of per-module abs-max over the last steps with the finding's cell marked, the early
  warnings and every finding.

The history layout (``Report.history``, may be ``{}``)::

    {"steps": [int, ...], "modules": [name, ...], "dtype": {name: "float32"},
     "absmax": [[float | None per step] per module], "rms": ..., "zeros": ..., "headroom": ...}

Floats may be ``"inf"`` / ``"nan"`` strings (JSON has no such numbers).
"""

from __future__ import annotations

import html as _html
import math
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._words import details, element_text, fmt, headline, num, recovery_rows

if TYPE_CHECKING:
    from .report import Report

__all__ = ["text", "html", "rich_renderables", "print_report"]

_NONE_FOUND = "nanhunt: no NaN/Inf found."


def _warning_line(w: Any) -> str:
    if not isinstance(w, dict):
        return str(w)
    msg = str(w.get("message") or w.get("kind") or w)
    where = []
    if w.get("step") is not None:
        where.append(f"step {w['step']}")
    if w.get("module"):
        where.append(f"`{w['module']}`")
    return (f"[{', '.join(where)}] " if where else "") + msg


def _recovery(report: Report) -> list[tuple[str, str]]:
    rows = recovery_rows(report.damage, report.skipped, report.bad_samples)
    return rows if report.damage_known else rows[1:]  # damage not measured: say nothing of it


# ------------------------------------------------------------------ terminal text
def text(report: Report) -> str:
    f = report.first
    lines: list[str] = []
    if f is None:
        lines.append(_NONE_FOUND)
    else:
        lines.append(headline(f))
        lines.append("")
        rows = details(f)
        w = max(len(k) for k, _ in rows)
        lines.extend(f"  {k:<{w}}  {v}" for k, v in rows)
        if len(f.chain) > 1:
            lines.append("")
            lines.append("  road to the value (oldest first):")
            lines.extend(f"    {i + 1}. {c}" for i, c in enumerate(f.chain))
        if f.hint:
            lines.append("")
            lines.append(f"  why: {f.hint}")
        recovery = _recovery(report)
        if recovery:
            lines.append("")
            lines.extend(f"  {k}: {v}" for k, v in recovery)
    if report.warnings:
        lines.append("")
        lines.append(f"Early warnings ({len(report.warnings)}):")
        lines.extend(f"  ! {_warning_line(w)}" for w in report.warnings)
    if len(report.findings) > 1:
        lines.append("")
        lines.append(f"All findings ({len(report.findings)}, in order):")
        for g in report.findings:
            lines.append(f"  step {g.step:>5}  {g.phase:<9}  {g.module or '<model>'}  {g.tensor}  ({g.cause})")
    return "\n".join(lines)


# ------------------------------------------------------------------ rich
def rich_renderables(report: Report) -> Iterator[Any]:
    """Renderables for ``rich`` (imported here only)."""
    try:
        from rich import box
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # pragma: no cover - Report.__rich_console__ is only called by rich itself
        yield text(report)
        return
    f = report.first
    if f is None:
        yield Text(_NONE_FOUND, style="bold green")
    else:
        yield Text(headline(f), style="bold red")
        t = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
        t.add_column(style="cyan", no_wrap=True)
        t.add_column()
        for k, v in details(f):
            t.add_row(k, v)
        yield t
        if len(f.chain) > 1:
            road = Text("road to the value: ", style="bold")
            for i, c in enumerate(f.chain):
                if i:
                    road.append(" → ", style="dim")
                road.append(c, style="magenta" if i == 0 else "")
            yield road
        if f.hint:
            yield Text.assemble(("why: ", "bold"), f.hint)
        for k, v in _recovery(report):
            yield Text.assemble((f"{k}: ", "bold"), (v, "green" if v.startswith("contained") else "red"))
    if report.warnings:
        yield Text(f"Early warnings ({len(report.warnings)}):", style="bold yellow")
        for w in report.warnings:
            yield Text("  ! " + _warning_line(w), style="yellow")
    if len(report.findings) > 1:
        t = Table(title=f"All findings ({len(report.findings)})", box=box.SIMPLE_HEAD)
        for col in ("step", "phase", "module", "tensor", "cause"):
            t.add_column(col, justify="right" if col == "step" else "left")
        for g in report.findings:
            t.add_row(str(g.step), g.phase, g.module or "<model>", g.tensor, g.cause)
        yield t


# ------------------------------------------------------------------ html
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1100px;
color:#1d2330;padding:0 16px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #dde;padding-bottom:4px}
.answer{font-size:17px;background:#fff2f0;border-left:5px solid #d93025;padding:12px 16px;margin:16px 0}
.ok{background:#eefaf0;border-left-color:#1e8e3e}
table.kv td{padding:2px 14px 2px 0;vertical-align:top}table.kv td:first-child{color:#5f6b7a;white-space:nowrap}
table.list{border-collapse:collapse}table.list td,table.list th{border-bottom:1px solid #eee;padding:3px 10px;
text-align:left}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px}
ol.chain li{margin:2px 0}.hint{color:#333;background:#f6f8fa;padding:8px 12px;border-radius:4px}
.warn{color:#8a5300;background:#fff8e1;padding:4px 10px;margin:3px 0;border-radius:3px}
.muted{color:#778}svg text{font-family:ui-monospace,Menlo,Consolas,monospace}
"""

_CELL_W, _CELL_H, _MAX_COLS, _MAX_ROWS = 22, 16, 64, 120


def _colour(v: float | None, lo: float, hi: float) -> str:
    """Light yellow (small) to dark red (large) on a log scale; non-finite black, unmeasured grey."""
    if v is None:
        return "#eceff3"
    if not math.isfinite(v):
        return "#111111"
    x = math.log10(abs(v)) if v != 0 else lo
    t = 0.0 if hi <= lo else min(1.0, max(0.0, (x - lo) / (hi - lo)))
    stops = [(255, 247, 188), (254, 196, 79), (236, 112, 20), (189, 0, 38), (90, 0, 40)]
    seg = min(int(t * (len(stops) - 1)), len(stops) - 2)
    u = t * (len(stops) - 1) - seg
    a, b = stops[seg], stops[seg + 1]
    return "#" + "".join(f"{round(a[i] + (b[i] - a[i]) * u):02x}" for i in range(3))


def _matrix(history: dict[str, Any], key: str, n_rows: int, n_cols: int) -> list[list[float | None]]:
    raw = history.get(key)
    out: list[list[float | None]] = []
    for r in range(n_rows):
        row = raw[r] if isinstance(raw, list) and r < len(raw) and isinstance(raw[r], list) else []
        out.append([num(row[c]) if c < len(row) else None for c in range(n_cols)])
    return out


def heatmap_svg(history: dict[str, Any], mark: tuple[str, int] | None = None) -> str:
    """An inline SVG heatmap of per-module abs-max (rows: modules, columns: steps); ``""`` if no data.

    ``mark`` is ``(module, step)``: that cell is outlined (its row and column are labelled in red).
    """
    if not isinstance(history, dict):
        return ""
    steps = [s for s in history.get("steps") or [] if isinstance(s, int)]
    modules = [str(m) for m in history.get("modules") or []]
    if not steps or not modules:
        return ""
    absmax = _matrix(history, "absmax", len(modules), len(steps))
    rms = _matrix(history, "rms", len(modules), len(steps))
    zeros = _matrix(history, "zeros", len(modules), len(steps))
    headroom = _matrix(history, "headroom", len(modules), len(steps))
    raw_dtypes = history.get("dtype")
    dtypes: dict[str, Any] = raw_dtypes if isinstance(raw_dtypes, dict) else {}
    c0 = max(0, len(steps) - _MAX_COLS)
    steps_shown = steps[c0:]
    rows = list(range(len(modules)))
    if len(rows) > _MAX_ROWS:  # keep the marked module visible
        keep = rows[:_MAX_ROWS]
        if mark is not None and mark[0] in modules and modules.index(mark[0]) not in keep:
            keep[-1] = modules.index(mark[0])
        rows = sorted(keep)
    finite = [abs(v) for r in rows for v in absmax[r][c0:] if v is not None and math.isfinite(v) and v != 0]
    lo = math.log10(min(finite)) if finite else 0.0
    hi = math.log10(max(finite)) if finite else 1.0
    mrow = rows.index(modules.index(mark[0])) if mark and mark[0] in modules and modules.index(mark[0]) in rows else None
    mcol = None
    if mark is not None:
        if mark[1] in steps_shown:
            mcol = steps_shown.index(mark[1])
        elif steps_shown and mark[1] > steps_shown[-1]:
            mcol = len(steps_shown)  # the finding's step was not measured: an extra column
    n_cols = len(steps_shown) + (1 if mcol == len(steps_shown) else 0)
    label_w = min(320, 8 + 7 * max(len(m or "<model>") for m in modules))
    top = 34
    width = max(label_w + n_cols * _CELL_W + 20, label_w + 530)
    height = top + len(rows) * _CELL_H + 60
    out = [
        f'<svg width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="per-module abs-max heatmap">'
    ]
    for j, s in enumerate(steps_shown + ([mark[1]] if mark and mcol == len(steps_shown) else [])):
        if j % max(1, n_cols // 16) and j != mcol:
            continue
        x = label_w + j * _CELL_W + _CELL_W / 2
        fill = "#d93025" if j == mcol else "#556"
        out.append(f'<text x="{x:.0f}" y="{top - 8}" font-size="10" text-anchor="middle" fill="{fill}">{s}</text>')
    out.append(f'<text x="{label_w}" y="12" font-size="11" fill="#556">step →</text>')
    for i, r in enumerate(rows):
        y = top + i * _CELL_H
        name = modules[r] or "<model>"
        short = name if len(name) * 7 <= label_w - 8 else "…" + name[-((label_w - 8) // 7 - 1):]
        fill = "#d93025" if i == mrow else "#223"
        weight = "bold" if i == mrow else "normal"
        out.append(
            f'<text x="{label_w - 6}" y="{y + _CELL_H - 4}" font-size="11" text-anchor="end" fill="{fill}" '
            f'font-weight="{weight}"><title>{_html.escape(name)}</title>{_html.escape(short)}</text>'
        )
        for j in range(n_cols):
            c = c0 + j
            v = absmax[r][c] if j < len(steps_shown) else None
            if j == len(steps_shown):  # the extra column of the finding's step
                v = math.nan if i == mrow else None
            at = steps_shown[j] if j < len(steps_shown) else (mark[1] if mark else "")
            tip = [f"{name} @ step {at}", f"abs-max {fmt(v)}"]
            if j < len(steps_shown):
                tip.append(f"rms {fmt(rms[r][c])}, zeros {fmt(zeros[r][c])}, headroom {fmt(headroom[r][c])}")
                if dtypes.get(modules[r]):
                    tip.append(str(dtypes[modules[r]]))
            out.append(
                f'<rect x="{label_w + j * _CELL_W}" y="{y}" width="{_CELL_W - 1}" height="{_CELL_H - 1}" '
                f'fill="{_colour(v, lo, hi)}"><title>{_html.escape(" · ".join(tip))}</title></rect>'
            )
    if mrow is not None and mcol is not None:
        out.append(
            f'<rect class="finding" x="{label_w + mcol * _CELL_W - 2}" y="{top + mrow * _CELL_H - 2}" '
            f'width="{_CELL_W + 3}" height="{_CELL_H + 3}" fill="none" stroke="#00b3ff" stroke-width="3"/>'
        )
    elif mcol is not None:  # the module is not in the history: mark the step
        out.append(
            f'<rect class="finding" x="{label_w + mcol * _CELL_W - 1}" y="{top - 2}" width="{_CELL_W + 1}" '
            f'height="{len(rows) * _CELL_H + 3}" fill="none" stroke="#00b3ff" stroke-width="2"/>'
        )
    # legend
    ly = top + len(rows) * _CELL_H + 18
    for k in range(10):
        v = 10 ** (lo + (hi - lo) * k / 9)
        out.append(f'<rect x="{label_w + k * 14}" y="{ly}" width="14" height="10" fill="{_colour(v, lo, hi)}"/>')
    out.append(f'<text x="{label_w - 6}" y="{ly + 9}" font-size="10" text-anchor="end" fill="#556">'
               f'{fmt(10 ** lo)}</text>')
    out.append(f'<text x="{label_w + 146}" y="{ly + 9}" font-size="10" fill="#556">{fmt(10 ** hi)} (log scale)</text>')
    lx = label_w + 290
    out.append(f'<rect x="{lx}" y="{ly}" width="14" height="10" fill="#111111"/>')
    out.append(f'<text x="{lx + 18}" y="{ly + 9}" font-size="10" fill="#556">nan/inf</text>')
    out.append(f'<rect x="{lx + 70}" y="{ly}" width="14" height="10" fill="#eceff3"/>')
    out.append(f'<text x="{lx + 88}" y="{ly + 9}" font-size="10" fill="#556">not measured</text>')
    out.append(f'<rect x="{lx + 176}" y="{ly - 1}" width="14" height="12" fill="none" stroke="#00b3ff" '
               f'stroke-width="3"/><text x="{lx + 196}" y="{ly + 9}" font-size="10" fill="#556">finding</text>')
    out.append("</svg>")
    return "".join(out)


def html(report: Report) -> str:
    """A self-contained HTML page: inline CSS and SVG only, nothing fetched."""
    e = _html.escape
    f = report.first
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>nanhunt report{': ' + e(f.module or '<model>') if f else ''}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>nanhunt report</h1>",
    ]
    meta = report.meta or {}
    info = [f"{k} {e(str(meta[k]))}" for k in ("steps", "mode", "torch", "rank") if meta.get(k) is not None]
    if info:
        parts.append(f"<div class='muted'>{' · '.join(info)}</div>")
    if f is None:
        parts.append(f"<div class='answer ok'>{e(_NONE_FOUND)}</div>")
    else:
        parts.append(f"<div class='answer' id='answer'>{e(headline(f))}</div>")
        parts.append("<table class='kv' id='details'>")
        parts.extend(f"<tr><td>{e(k)}</td><td class='mono'>{e(v)}</td></tr>" for k, v in details(f))
        parts.append("</table>")
        if f.chain:
            parts.append("<h2>Road to the value (oldest first)</h2><ol class='chain mono'>")
            parts.extend(f"<li>{e(c)}</li>" for c in f.chain)
            parts.append("</ol>")
        if f.hint:
            parts.append(f"<p class='hint'><b>Why:</b> {e(f.hint)}</p>")
        recovery = _recovery(report)
        if recovery:
            parts.append("<table class='kv' id='recovery'>")
            parts.extend(f"<tr><td>{e(k)}</td><td class='mono'>{e(v)}</td></tr>" for k, v in recovery)
            parts.append("</table>")
    parts.append("<h2>Per-module abs-max over the last steps</h2>")
    svg = heatmap_svg(report.history, (f.module, f.step) if f is not None else None)
    if svg:
        parts.append(f"<div id='heatmap' style='overflow-x:auto'>{svg}</div>")
        parts.append("<p class='muted'>Rows are modules, columns are training steps; colour is the largest "
                     "absolute value of the module's output (log scale). Hover a cell for RMS, fraction of zeros "
                     "and headroom to the dtype's largest value.</p>")
    else:
        parts.append("<p class='muted'>No magnitude history was recorded for this run.</p>")
    parts.append(f"<h2>Early warnings ({len(report.warnings)})</h2>")
    if report.warnings:
        parts.extend(f"<div class='warn'>{e(_warning_line(w))}</div>" for w in report.warnings)
    else:
        parts.append("<p class='muted'>None.</p>")
    if report.findings:
        parts.append(f"<h2>All findings ({len(report.findings)}, in order)</h2><table class='list'>")
        parts.append("<tr><th>step</th><th>phase</th><th>module</th><th>tensor</th><th>cause</th><th>op</th></tr>")
        for g in report.findings:
            parts.append(
                f"<tr><td>{g.step}</td><td>{e(g.phase)}</td><td class='mono'>{e(g.module or '<model>')}</td>"
                f"<td class='mono'>{e(element_text(g))}</td><td>{e(g.cause)}</td><td class='mono'>{e(g.op or '')}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def print_report(report: Report, stream: Any = None) -> None:
    """Print with rich when installed and writing to a terminal; plain text otherwise."""
    stream = stream or sys.stdout
    if stream.isatty():
        try:
            from rich.console import Console
        except ImportError:
            pass
        else:
            Console(file=stream).print(report)
            return
    print(report, file=stream)
