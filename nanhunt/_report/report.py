"""`Report`: the findings, the magnitude history and the early warnings, as plain data.

Rendering lives elsewhere (`render`): this module only holds data and writes files atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .._files import (
    MAX_REPORT_BYTES,
    FileFormatError,
    atomic_write,
    check_depth,
    checked_fields,
    fspath,
    need,
    read_limited,
)
from .._finding import Finding
from .render import html, rich_renderables, text
from .sources import read_sources

__all__ = ["Report", "SCHEMA"]

SCHEMA = "nanhunt.report/1"
DAMAGE_KINDS = ("grads", "parameters", "buffers", "optimizer_state")


class Report:
    """What a hunt found. ``str(report)`` is the terminal text; ``save(path)`` writes a file."""

    def __init__(
        self,
        findings: Sequence[Finding] = (),
        history: dict[str, Any] | None = None,
        warnings: Sequence[dict[str, Any]] = (),
        meta: dict[str, Any] | None = None,
        sources: dict[str, str] | None = None,
        damage: Mapping[str, Sequence[str]] | None = None,
        skipped: Sequence[int] = (),
        bad_samples: Sequence[int] = (),
    ) -> None:
        self.findings: list[Finding] = list(findings)
        self.history: dict[str, Any] = dict(history or {})
        self.warnings: list[dict[str, Any]] = list(warnings)
        self.meta: dict[str, Any] = dict(meta or {})
        # the text of each source line the findings name ("file.py:LINE" -> text), read now
        self.sources: dict[str, str] = dict(sources) if sources is not None else read_sources(self.findings)
        # persistent state holding NaN/Inf when the reported step ended (all empty: contained)
        self.damage: dict[str, list[str]] = {k: list((damage or {}).get(k, ())) for k in DAMAGE_KINDS}
        self.damage_known = damage is not None  # read when a step had a finding (else not measured)
        self.skipped: list[int] = list(skipped)  # steps dropped by on_find="skip"
        self.bad_samples: list[int] = sorted(bad_samples)  # dataset indices (watch(loader=...))

    @property
    def first(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "first": self._finding_dict(self.first) if self.first else None,
            "findings": [self._finding_dict(f) for f in self.findings],
            "history": self.history,
            "warnings": self.warnings,
            "meta": self.meta,
            "sources": self.sources,
            "damage": self.damage if self.damage_known else None,
            "skipped": self.skipped,
            "bad_samples": self.bad_samples,
        }

    def _finding_dict(self, f: Finding) -> dict[str, Any]:
        """The finding's fields plus ``source_text``: the text of its ``source`` line, or None."""
        return {**f.to_dict(), "source_text": self.sources.get(f.source) if f.source else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        """A report read back (maybe someone else's): every field is checked; a wrong one raises
        `FileFormatError` (a `ValueError`) naming it, e.g. ``findings[0].step must be an int``."""
        if not isinstance(d, dict) or not str(d.get("schema", "")).startswith("nanhunt.report/"):
            raise FileFormatError("not a nanhunt report: the 'schema' field is missing or unknown")
        if d["schema"] != SCHEMA:  # its fields may mean other things: say so, not "findings[0].x is missing"
            raise FileFormatError(f"a report of another nanhunt version (schema {str(d['schema'])[:40]!r}; this "
                                  f"nanhunt reads {SCHEMA!r}): read it with the nanhunt that wrote it")
        found = need(d, "findings", list, "report", [])
        findings = [checked_fields(Finding, f, f"findings[{i}]", Finding.from_dict) for i, f in enumerate(found)]
        first = need(d, "first", dict[str, Any] | None, "report", None)
        if "first" in d and (first is not None or findings) and (
                first is None or not findings or checked_fields(Finding, first, "first", Finding.from_dict) != findings[0]):
            raise FileFormatError("report.first is not findings[0] (the file was edited or is not one nanhunt wrote)")
        history = need(d, "history", dict[str, Any] | None, "report", None) or {}
        for key, tp in _HISTORY.items():
            need(history, key, tp, "report.history", None)
        return cls(
            findings,
            history=history,
            warnings=need(d, "warnings", list[dict[str, Any]] | None, "report", None) or [],
            meta=need(d, "meta", dict[str, Any] | None, "report", None) or {},
            sources={str(k): str(v) for k, v in (need(d, "sources", dict[str, Any] | None, "report", None) or {}).items()},
            damage=need(d, "damage", dict[str, list[str]] | None, "report", None),
            skipped=need(d, "skipped", list[int] | None, "report", None) or [],
            bad_samples=need(d, "bad_samples", list[int] | None, "report", None) or [],
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Report:
        """A report saved as ``.json``. A file that is not one raises `FileFormatError` (a
        `ValueError`) naming it: not UTF-8 text, not JSON, nested deeper than a report, larger than
        `MAX_REPORT_BYTES`, or not a regular file (a folder, ``/dev/zero``, a FIFO: never read);
        a missing file raises `FileNotFoundError`."""
        p = fspath(path, "Report.load() takes the path of a report saved as .json")
        raw = read_limited(p, "report", MAX_REPORT_BYTES)
        try:
            doc = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FileFormatError(f"{p} is not a JSON report: not a text file (no UTF-8 at byte {e.start}; "
                                  f"a report is the .json a watch wrote)") from None
        try:
            d = json.loads(doc)
        except json.JSONDecodeError as e:
            raise FileFormatError(f"{p} is not a JSON report: {e}") from None
        except RecursionError:
            raise FileFormatError(f"{p} is not a JSON report: nested too deeply") from None
        except ValueError as e:  # a number of more digits than int() takes
            raise FileFormatError(f"{p} is not a JSON report: {e}") from None
        check_depth(d, p)
        return cls.from_dict(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False, default=_plain)

    def to_text(self) -> str:
        return text(self)

    def to_html(self) -> str:
        return html(self)

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write by suffix (``.json``, ``.html``, ``.txt``), atomically; returns the path."""
        p = fspath(path, "Report.save() takes a path ending in .json, .html or .txt")
        suffix = os.path.splitext(p)[1].lower()
        if suffix == ".json":
            data = self.to_json()
        elif suffix == ".html":
            data = self.to_html()
        elif suffix == ".txt":
            data = self.to_text()
        else:
            raise ValueError(f"report path must end in .json, .html or .txt; got {p!r}")

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8", errors="backslashreplace") as fh:  # never fails on a name
                fh.write(data)

        return atomic_write(p, suffix, write)

    def to_tensorboard(self, writer: Any, prefix: str = "nanhunt") -> int:
        """Write the magnitude history and the findings to a TensorBoard ``SummaryWriter``.

        Per module ``nanhunt/absmax/<module>`` and ``nanhunt/rms/<module>`` at each recorded step,
        the finding's value at its step, the report's text (``nanhunt/report``) and each finding's
        summary (``nanhunt/findings``). Returns how many values were written.
        """
        from .tensorboard import to_tensorboard

        return to_tensorboard(self, writer, prefix)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<nanhunt.Report findings={len(self.findings)} first={self.first.module if self.first else None!r}>"

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from rich_renderables(self)


# the history's fields as `_record.history` writes them (each may be absent)
_HISTORY: dict[str, Any] = {
    "steps": list[int], "modules": list[str], "dtype": dict[str, str],
    **{k: list[list[float | None]] for k in ("absmax", "rms", "zeros", "headroom")},
}


def _plain(o: Any) -> Any:
    if isinstance(o, float):
        return str(o)
    if isinstance(o, (tuple, set)):
        return list(o)
    return str(o)
