"""The words of a finding's summary: one place for the headline, the paragraph (the
`NonFiniteError` message) and the rows every renderer shows (a leaf: plain data in, text out)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._finding import Finding

__all__ = ["headline", "paragraph", "details", "fmt", "num", "element_text", "shape_text", "PHASE_WORDS", "CAUSE_WORDS",
           "damage_text", "recovery_rows"]

_KIND = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}

PHASE_WORDS = {
    "forward": "forward of",
    "backward": "backward of",
    "grad": "accumulated gradient of",
    "optimizer": "optimizer step, in",
    "check": "checked tensor",
    "checkpoint": "checkpoint",
}

DAMAGE_WORDS = {"grads": "gradients", "parameters": "weights", "buffers": "buffers", "optimizer_state": "optimizer state"}

CAUSE_WORDS = {
    "created": "born here",
    "input": "fed in by a non-finite input",
    "parameter": "from a non-finite parameter or buffer (poisoned weights)",
    "unknown": "origin unknown",
}

# ------------------------------------------------------------------ plain data helpers
def num(v: Any) -> float | None:
    """A history or finding value as a float (``"inf"``/``"nan"`` strings included); else None."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def fmt(v: Any) -> str:
    x = num(v)
    if x is None:
        return "—"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e5:
        return f"{x:.4g}"
    return f"{x:.3e}"


def _kind(f: Finding) -> str:
    v = num(f.value)
    if v is None:
        c = f.counts or {}
        for k in ("nan", "+inf", "-inf"):
            if c.get(k):
                return _KIND[k]
        return "NaN/Inf"
    if math.isnan(v):
        return "NaN"
    return "+Inf" if v > 0 else "-Inf"


def _where(f: Finding) -> str:
    if f.phase in ("check", "checkpoint"):
        return f"`{f.module}`"
    return f"`{f.module or '<model>'}` ({f.module_type})"


def element_text(f: Finding) -> str:
    idx = "" if f.index is None else "[" + ", ".join(map(str, f.index)) + "]"
    val = "" if f.value is None else f" = {fmt(f.value)}"
    return f"{f.tensor}{idx}{val}"


def headline(f: Finding) -> str:
    """The one-sentence answer, e.g. ``First NaN: forward of `attn` (Attention) at step 41 — ...``."""
    phase = PHASE_WORDS.get(f.phase, f.phase)
    if f.phase == "checkpoint":  # a tensor about to be saved (guard) or in a saved file (audit)
        at = f" at step {f.step}" if f.step >= 0 else ""
        rank = f" (rank {f.rank})" if f.rank is not None else ""
        return f"{_kind(f)} in {phase} {_where(f)}{at} — {element_text(f)}{rank}."
    s = f"First {_kind(f)}: {phase} {_where(f)} at step {f.step}"
    if f.call:
        s += f" (call {f.call})"
    s += f" — {element_text(f)}"
    tail = CAUSE_WORDS.get(f.cause, f.cause)
    if f.op:
        tail += f" in {f.op}" if f.cause == "created" else f"; created in {f.op}"
        if f.source:
            tail += f" at {f.source}"
    if f.rank is not None:
        tail += f" (rank {f.rank})"
    return f"{s}, {tail}."


def shape_text(shape: Any) -> str:
    shape = tuple(shape)
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def paragraph(f: Finding) -> str:
    """The one-paragraph answer: the headline, then shape and counts, the road, the hint."""
    parts = [headline(f)]
    if f.dtype:
        counts = ", ".join(f"{f.counts.get(k, 0)} {k}" for k in ("nan", "+inf", "-inf")) if f.counts else "counts unknown"
        parts.append(f"{f.tensor} has shape {shape_text(f.shape)}, {f.dtype}; {counts}.")
    if len(f.chain) > 1:
        parts.append("Road: " + " -> ".join(f.chain) + ".")
    if f.reproducible is False:
        parts.append("Replaying the step did not reproduce it.")
    if f.hint:
        parts.append(f.hint)
    return " ".join(parts)


def details(f: Finding) -> list[tuple[str, str]]:
    """The finding as (label, value) rows, in reading order."""
    rows = [
        ("phase", f.phase),
        ("module", f"{f.module or '<model>'} ({f.module_type})" if f.phase != "check" else f.module),
        ("tensor", f"{f.tensor}  shape {shape_text(f.shape)}  {f.dtype}"),
        ("step", f"{f.step}  (call {f.call})"),
    ]
    if f.index is not None:
        rows.append(("element", f"[{', '.join(map(str, f.index))}] = {fmt(f.value)}"))
    if f.counts:
        rows.append(("counts", ", ".join(f"{f.counts.get(k, 0)} {k}" for k in ("nan", "+inf", "-inf"))))
    rows.append(("cause", f"{f.cause} — {CAUSE_WORDS.get(f.cause, '')}"))
    if f.op:
        rows.append(("op", f.op + (f" at {f.source}" if f.source else "")))
    elif f.source:
        rows.append(("source", f.source))
    if f.rank is not None:
        rows.append(("rank", str(f.rank)))
    if f.reproducible is not None:
        rows.append(("replayed", "reproduced" if f.reproducible else "did NOT reproduce"))
    if f.samples:
        rows.append(("samples", "dataset indices " + ", ".join(map(str, f.samples))))
    return rows


def damage_text(damage: dict[str, Any] | None) -> str:
    """``Report.damage`` in one line: ``contained`` or what the NaN reached, by name."""
    parts = []
    for k, words in DAMAGE_WORDS.items():
        names = list((damage or {}).get(k) or ())
        if names:
            shown = ", ".join(names[:6]) + (f", … ({len(names)} in all)" if len(names) > 6 else "")
            parts.append(f"{words}: {shown}")
    if not parts:
        return "contained: no gradient, weight, buffer or optimizer state holds NaN/Inf"
    return "reached " + "; ".join(parts)


def recovery_rows(damage: dict[str, Any] | None, skipped: Any, bad_samples: Any) -> list[tuple[str, str]]:
    """A report's damage, skipped steps and bad samples as (label, value) rows."""
    rows = [("damage", damage_text(damage))]
    if skipped:
        rows.append(("skipped steps", ", ".join(map(str, skipped))))
    if bad_samples:
        rows.append(("bad samples", ", ".join(map(str, bad_samples))))
    return rows
