"""The words of a finding's summary: one place for the headline, the paragraph (the
`NonFiniteError` message) and the rows every renderer shows (a leaf: plain data in, text out)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._finding import Finding

__all__ = ["headline", "paragraph", "details", "fmt", "num", "element_text", "shape_text", "PHASE_WORDS", "CAUSE_WORDS",
           "VERDICT_WORDS", "verdict_words", "reference_text", "remedy", "damage_text", "recovery_rows", "one_line", "visible"]

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

VERDICT_WORDS = {
    "numerics": "non-finite in float32 eager too: the math itself",
    "precision": "finite in float32: the range of the reduced dtype",
    "compiler": "only under torch.compile: eager is finite",
    "nondeterministic": "identical replays disagree",
    "transient": "no replay reproduces it: state the replay cannot restore, or the device",
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
    idx = "" if not f.index else "[" + ", ".join(map(str, f.index)) + "]"  # () : a 0-dim tensor
    val = "" if f.value is None else f" = {fmt(f.value)}"
    return f"{f.tensor}{idx}{val}"


# control characters (newlines too) and bidi overrides in names the user's code chose (a module
# named "a\nFirst NaN: ..." would fake a line): escaped in every sentence made here
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}
_CONTROL.update({c: f"\\u{c:04x}" for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]})
_CONTROL_TEXT = {c: v for c, v in _CONTROL.items() if c not in (0x09, 0x0A)}  # a text's own lines and tabs kept


def one_line(s: str) -> str:
    """``s`` (a name, or a sentence holding names: a hint, a warning, a damage list) with control
    characters, newlines included, and bidi overrides escaped: it stays on its own line."""
    return s.translate(_CONTROL)


def visible(s: str) -> str:
    """``s`` (a whole rendered text) with control characters but tab and newline escaped: what a
    terminal or a page shows as it is, never a terminal command (an escape sequence in a name)."""
    return s.translate(_CONTROL_TEXT)


def _names_safe(f: Finding) -> Finding:
    """``f`` with its names (module, class, tensor, file path, chain) and its hint (which names
    them) safe to put in one line."""
    names = (f.module, f.module_type, f.tensor, f.source or "", f.hint, *f.chain)
    if all(n.isprintable() and one_line(n) == n for n in names):
        return f
    import dataclasses

    return dataclasses.replace(
        f, module=one_line(f.module), module_type=one_line(f.module_type), tensor=one_line(f.tensor),
        source=one_line(f.source) if f.source else f.source, hint=one_line(f.hint),
        chain=tuple(map(one_line, f.chain)))


def headline(f: Finding, first: bool = True) -> str:
    """The one-sentence answer, e.g. ``First NaN: forward of `attn` (Attention) at step 41 — ...``
    (``first=False``: a later finding, headed by its kind only)."""
    f = _names_safe(f)
    phase = PHASE_WORDS.get(f.phase, f.phase)
    if f.phase == "checkpoint":  # a tensor about to be saved (guard) or in a saved file (audit)
        at = f" at step {f.step}" if f.step >= 0 else ""
        rank = f" (rank {f.rank})" if f.rank is not None else ""
        return f"{_kind(f)} in {phase} {_where(f)}{at} — {element_text(f)}{rank}."
    kind = _kind(f)
    s = f"{'First ' + kind if first else kind}: {phase} {_where(f)} at step {f.step}"
    if f.call:
        s += f" (call {f.call})"
    if f.evaluation:
        s += ", in evaluation (eval mode, gradients off)"
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


def paragraph(f: Finding, first: bool = True) -> str:
    """The one-paragraph answer: the headline, then shape and counts, the road, the hint."""
    f = _names_safe(f)
    parts = [headline(f, first)]
    if f.dtype:
        counts = ", ".join(f"{f.counts.get(k, 0)} {k}" for k in ("nan", "+inf", "-inf")) if f.counts else "counts unknown"
        parts.append(f"{f.tensor} has shape {shape_text(f.shape)}, {f.dtype}; {counts}.")
    if len(f.chain) > 1:
        parts.append("Road: " + " -> ".join(f.chain) + ".")
    if f.reproducible is False and f.verdict is None:
        parts.append("Replaying the step did not reproduce it.")
    if f.verdict:
        parts.append(f"Verdict: {f.verdict} ({verdict_words(f)}); {reference_text(f)}.")
    if f.hint:
        parts.append(f.hint)
    return " ".join(parts)


def details(f: Finding, sources: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The finding as (label, value) rows, in reading order; ``sources`` gives the source line's text."""
    if sources and f.source and f.source in sources:
        sources = {**sources, one_line(f.source): sources[f.source]}
    f = _names_safe(f)
    rows = [
        ("phase", f.phase),
        ("module", f"{f.module or '<model>'} ({f.module_type})" if f.phase != "check" else f.module),
        ("tensor", f"{f.tensor}  shape {shape_text(f.shape)}  {f.dtype}" if f.dtype
         else f"{f.tensor}  (shape and dtype unknown: gone before the analysis, and no replay reproduced it)"),
        ("step", f"{f.step}  (call {f.call}{', in evaluation' if f.evaluation else ''})"),
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
    if f.source and sources and sources.get(f.source):
        rows.append(("line", sources[f.source]))
    if f.rank is not None:
        rows.append(("rank", str(f.rank)))
    if f.reproducible is not None:
        rows.append(("replayed", "reproduced" if f.reproducible else "did NOT reproduce"))
    if f.verdict:
        rows.append(("verdict", f"{f.verdict} — {verdict_words(f)}"))
        rows.append(("reference", reference_text(f)))
        rows.append(("remedy", remedy(f)))
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


# ------------------------------------------------------------------ verdicts
def verdict_words(f: Finding) -> str:
    """`VERDICT_WORDS` for ``f``: "numerics" names the dtype its reference ran in (a float64 or
    complex model's is its own, not float32)."""
    if f.verdict == "numerics":
        return f"non-finite in {f.reference.get('dtype', 'float32')} eager too: the math itself"
    return VERDICT_WORDS.get(f.verdict or "", "")


def reference_text(f: Finding) -> str:
    """What the reference replay saw, against the failing run: one line."""
    r = f.reference
    v, op = f.verdict, r.get("op")
    at = f" at {op}" if op else ""
    if v == "precision":
        # the op's own float32 value, or (``tensor``) the reported element's when no op passed the range
        s = f"float32 gives {_exact(r.get('value'))} in {r['tensor']}" if r.get("tensor") else f"float32{at} = {_exact(r.get('value'))}"
        lim, val = r.get("limit"), r.get("value")
        if r.get("underflow"):
            dt = r.get("failing_dtype", "the dtype")
            if r.get("cancelled"):
                return (s + f", a difference of two values that {dt} rounds to the same number: 0 "
                        f"(failing run: {fmt(r.get('failing', 0.0))})")
            return (s + f", below {dt}'s smallest normal value {_exact(r.get('smallest'))}: {dt} rounds it to 0 "
                    f"(failing run: {fmt(r.get('failing', 0.0))})")
        if lim is not None:
            dt = r.get("failing_dtype", "the dtype")
            if isinstance(val, (int, float)) and math.isfinite(val) and abs(val) <= lim:
                # the value itself fits: on the way to it the dtype's range (x * x past the max, then
                # * 0) or its rounding (E[x^2] - E[x]^2 coming out below 0) made the difference
                s += (f", within {dt}'s range: on the way there a value passed its largest value {_exact(lim)} "
                      f"or {dt}'s rounding made a difference (a variance E[x^2] - E[x]^2 below 0)")
            else:
                s += f", past {dt}'s largest value {_exact(lim)}"
        return s + f" (failing run: {fmt(r.get('failing', f.value))})"
    if v == "numerics":
        where = f" in {r['tensor']}" if r.get("tensor") else at  # the reported element's value, not the op's
        return f"{r.get('dtype', 'float32')} eager gives {fmt(r.get('value', f.value))}{where} too"
    if v == "compiler":
        node = f" (graph node {r['node']})" if r.get("node") else ""
        val = f" = {_exact(r['value'])} (compiled: {fmt(r.get('failing', f.value))})" if "value" in r else " is finite"
        return f"eager{at}{node}{val}"
    device = f"{r.get('device', '?')} on host {r.get('host', '?')}" + (f", uuid {r['uuid']}" if r.get("uuid") else "")
    if v == "nondeterministic":
        return f"{r.get('reproduced', '?')} of {r.get('replays', '?')} identical replays reproduced it; {device}"
    if v == "transient":
        return f"none of {r.get('replays', '?')} replays reproduced it; {device}"
    return ", ".join(f"{k} {fmt(x) if isinstance(x, float) else x}" for k, x in r.items())


def _exact(v: Any) -> str:
    """A reference value as it is (``106901.2``, ``65504``), not rounded to four digits."""
    x = num(v)
    return f"{x:.7g}" if x is not None and math.isfinite(x) else fmt(v)


# words with which a hint names its own fix (hints.py: "take (x + eps) ** p", "Let the loss use the
# eigenvalues only", "leave at least one position unmasked"); a hint without them names only the mechanism
_FIX_WORDS = re.compile(r"\b(use|take|clamp|keep|guard|leave|pass|skip|drop|mask with|compute it|let the loss|perturb|"
                        r"lower|clip|prune|look for|find the|check|filter|restore|re-initialise|divide by max)\b", re.I)


def remedy(f: Finding) -> str:
    """The usual remedy for the finding's verdict (empty when there is no verdict)."""
    v, op = f.verdict, f.reference.get("op") or f.op or "that op"
    if v == "numerics" and _FIX_WORDS.search(f.hint):
        # the hint knows this mechanism's fix (an epsilon on eigh's diagonal does not help, a masked row
        # wants a position left unmasked, an overflow wants smaller values): the remedy defers to it
        return "More precision will not help: the math itself makes it; the fix is the one the hint (why) gives."
    if v == "numerics":
        return ("More precision will not help: guard the op's domain (clamp or add an epsilon before a "
                "log/sqrt/division, mask after a softmax, not before it with -inf on a whole row).")
    if v == "precision" and f.reference.get("cancelled"):
        return (f"Run {op} and what feeds it in float32 (keep it out of autocast, or .float() around it), or do "
                "not subtract nearly equal values: 1 - sigmoid(z) is sigmoid(-z), log(sigmoid(z)) is "
                "F.logsigmoid(z), and a binary cross-entropy of logits is F.binary_cross_entropy_with_logits.")
    if v == "precision" and f.reference.get("underflow"):
        wider = " or use bfloat16 (float32's range)" if f.reference.get("failing_dtype") == "float16" else ""
        return (f"Run {op} in float32 (keep it out of autocast, or .float() around it){wider}, or keep what "
                "follows from the 0 it rounds to (an epsilon or clamp before a log, a division, a sqrt's gradient).")
    if v == "precision":
        wider = " or use bfloat16 (float32's range)" if f.reference.get("failing_dtype") == "float16" else ""
        return (f"Run {op} in float32 (keep it out of autocast, or .float() around it), or keep its inputs "
                f"smaller (normalise before it, a smaller init, a lower learning rate){wider}.")
    if v == "compiler":
        return (f"Eager is finite: the compiled graph's {op} is wrong. Run that module eagerly "
                "(torch.compiler.disable) or with another backend, and report the graph node upstream.")
    if v == "nondeterministic":
        return ("Make the run repeatable (torch.use_deterministic_algorithms(True), fixed seeds) and look for "
                "state that changes between calls (a counter, a racing in-place write, uninitialised memory).")
    if v == "transient":
        return ("Nothing reproduces it from the same inputs, weights and RNG state: look for state a replay "
                "cannot restore (Python state in forward: a counter, a cache, a flag that changes per call; data "
                "written in place since), and on a GPU suspect the device (ECC errors in nvidia-smi -q, DCGM "
                "diagnostics): rerun the step there and on another device.")
    return ""
