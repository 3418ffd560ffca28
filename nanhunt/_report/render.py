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
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._words import details, element_text, headline, one_line, recovery_rows, visible
from .heatmap import heatmap_svg
from .sources import road_location

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
    return one_line((f"[{', '.join(where)}] " if where else "") + msg)  # names the user's module


def _road(chain: tuple[str, ...], sources: dict[str, str]) -> list[tuple[str, str | None]]:
    """Each road step with the text of its line, given once: at the first step on that line."""
    out: list[tuple[str, str | None]] = []
    last = None
    for c in chain:
        loc = road_location(c)
        out.append((one_line(c), sources.get(loc) if loc and loc != last else None))
        last = loc
    return out


def _recovery(report: Report) -> list[tuple[str, str]]:
    rows = [(k, one_line(v)) for k, v in recovery_rows(report.damage, report.skipped, report.bad_samples)]
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
        rows = details(f, report.sources)
        w = max(len(k) for k, _ in rows)
        lines.extend(f"  {k:<{w}}  {v}" for k, v in rows)
        if len(f.chain) > 1:
            lines.append("")
            lines.append("  road to the value (oldest first):")
            for i, (c, line) in enumerate(_road(f.chain, report.sources)):
                lines.append(f"    {i + 1}. {c}")
                if line:
                    lines.append(f"         {line}")
        if f.hint:
            lines.append("")
            lines.append(f"  why: {one_line(f.hint)}")
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
            lines.append(f"  step {g.step:>5}  {g.phase:<9}  {one_line(g.module or '<model>')}  {one_line(g.tensor)}  ({g.cause})")
    return visible("\n".join(lines))  # a name's escape sequence is no terminal command, in a .txt file too


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
        for k, v in details(f, report.sources):
            t.add_row(k, Text(visible(v)))  # Text: a source line like `x[mask]` is not rich markup
        yield t
        if len(f.chain) > 1:
            road = Text("road to the value (oldest first):", style="bold")
            for i, (c, line) in enumerate(_road(f.chain, report.sources)):
                road.append(f"\n  {i + 1}. ")
                road.append(c, style="magenta" if i == 0 else "")
                if line:
                    road.append(f"\n       {visible(line)}", style="dim")
            yield road
        if f.hint:
            yield Text.assemble(("why: ", "bold"), one_line(f.hint))
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
            t.add_row(*(Text(one_line(str(c))) for c in (g.step, g.phase, g.module or "<model>", g.tensor, g.cause)))
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
ol.chain li{margin:2px 0}.src{color:#5f6b7a;padding-left:1.5em;white-space:pre-wrap}.hint{color:#333;background:#f6f8fa;padding:8px 12px;border-radius:4px}
.warn{color:#8a5300;background:#fff8e1;padding:4px 10px;margin:3px 0;border-radius:3px}
.muted{color:#778}svg text{font-family:ui-monospace,Menlo,Consolas,monospace}
"""

def html(report: Report) -> str:
    """A self-contained HTML page: inline CSS and SVG only, nothing fetched."""

    def e(s: str) -> str:  # markup escaped, and control characters and bidi overrides shown escaped
        return _html.escape(visible(s))

    f = report.first
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>nanhunt report{': ' + e(one_line(f.module or '<model>')) if f else ''}</title>",
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
        parts.extend(f"<tr><td>{e(k)}</td><td class='mono'>{e(v)}</td></tr>"
                     for k, v in details(f, report.sources))
        parts.append("</table>")
        if f.chain:
            parts.append("<h2>Road to the value (oldest first)</h2><ol class='chain mono'>")
            parts.extend(f"<li>{e(c)}" + (f"<div class='src'>{e(line)}</div>" if line else "") + "</li>"
                         for c, line in _road(f.chain, report.sources))
            parts.append("</ol>")
        if f.hint:
            parts.append(f"<p class='hint'><b>Why:</b> {e(one_line(f.hint))}</p>")
        recovery = _recovery(report)
        if recovery:
            parts.append("<table class='kv' id='recovery'>")
            parts.extend(f"<tr><td>{e(k)}</td><td class='mono'>{e(v)}</td></tr>" for k, v in recovery)
            parts.append("</table>")
    parts.append("<h2>Per-module abs-max over the last steps</h2>")
    svg = heatmap_svg(report.history, (f.module, f.step) if f is not None else None, f.value if f is not None else None)
    if svg:
        parts.append(f"<div id='heatmap' style='overflow-x:auto'>{svg}</div>")
        parts.append("<p class='muted'>Rows are modules (each parent above its children), columns are the sampled "
                     "training steps (0-based); colour is the largest absolute value of the module's output (log "
                     "scale). The finding's cell is outlined. Hover a cell for RMS, fraction of zeros and headroom to "
                     "the dtype's largest value.</p>")
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
                f"<tr><td>{e(str(g.step))}</td><td>{e(g.phase)}</td><td class='mono'>{e(one_line(g.module or '<model>'))}</td>"
                f"<td class='mono'>{e(one_line(element_text(g)))}</td><td>{e(g.cause)}</td><td class='mono'>{e(g.op or '')}</td></tr>"
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
    print(printable(str(report), getattr(stream, "encoding", None)), file=stream)


def printable(s: str, encoding: str | None = None) -> str:
    """``s`` safe to print: control characters escaped, and what ``encoding`` cannot hold (a lone
    surrogate in a module name) backslash-escaped instead of raising."""
    s = visible(s)  # a report's strings are data, never terminal commands
    enc = encoding or "utf-8"
    try:
        return s.encode(enc, "backslashreplace").decode(enc)
    except LookupError:
        return s
