"""Renderers for a `Report`: terminal text (rich when installed) and a self-contained HTML page."""

from __future__ import annotations

import html as _html
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._report import Report

__all__ = ["text", "html", "rich_renderables"]


def text(report: Report) -> str:
    f = report.first
    if f is None:
        return "nanhunt: no NaN/Inf found."
    lines = [f.summary(), ""]
    lines.append(f"  phase   {f.phase}")
    lines.append(f"  module  {f.where} ({f.module_type})")
    lines.append(f"  tensor  {f.tensor}  shape={tuple(f.shape)} dtype={f.dtype}")
    lines.append(f"  step    {f.step}  call {f.call}")
    if f.index is not None:
        lines.append(f"  element {list(f.index)} = {f.value}")
    if f.counts:
        lines.append("  counts  " + ", ".join(f"{k}={v}" for k, v in f.counts.items()))
    lines.append(f"  cause   {f.cause}")
    if f.op:
        lines.append(f"  op      {f.op}" + (f" at {f.source}" if f.source else ""))
    for i, c in enumerate(f.chain):
        lines.append(f"  chain {i:>2} {c}")
    if len(report.findings) > 1:
        lines.append("")
        lines.append(f"{len(report.findings)} findings:")
        for g in report.findings:
            lines.append(f"  step {g.step:>5} {g.phase:<9} {g.where} {g.tensor} ({g.cause})")
    for w in report.warnings:
        lines.append(f"warning: {w.get('message', w)}")
    return "\n".join(lines)


def rich_renderables(report: Report) -> Any:
    yield text(report)


def html(report: Report) -> str:
    body = _html.escape(text(report))
    data = _html.escape(json.dumps(report.to_dict(), default=str))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>nanhunt report</title></head>"
        f"<body><pre>{body}</pre><script type='application/json' id='report'>{data}</script></body></html>"
    )
