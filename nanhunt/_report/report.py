"""`Report`: the findings, the magnitude history and the early warnings, as plain data.

Rendering lives elsewhere (`render`): this module only holds data and writes files atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .._files import atomic_write
from .._finding import Finding
from .render import html, rich_renderables, text

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
        damage: Mapping[str, Sequence[str]] | None = None,
        skipped: Sequence[int] = (),
        bad_samples: Sequence[int] = (),
    ) -> None:
        self.findings: list[Finding] = list(findings)
        self.history: dict[str, Any] = dict(history or {})
        self.warnings: list[dict[str, Any]] = list(warnings)
        self.meta: dict[str, Any] = dict(meta or {})
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
            "first": self.first.to_dict() if self.first else None,
            "findings": [f.to_dict() for f in self.findings],
            "history": self.history,
            "warnings": self.warnings,
            "meta": self.meta,
            "damage": self.damage if self.damage_known else None,
            "skipped": self.skipped,
            "bad_samples": self.bad_samples,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        if not isinstance(d, dict) or not str(d.get("schema", "")).startswith("nanhunt.report/"):
            raise ValueError("not a nanhunt report: the 'schema' field is missing or unknown")
        return cls(
            [Finding.from_dict(f) for f in d.get("findings", [])],
            history=d.get("history") or {},
            warnings=d.get("warnings") or [],
            meta=d.get("meta") or {},
            damage=d.get("damage") or None,
            skipped=[int(s) for s in d.get("skipped") or ()],
            bad_samples=[int(i) for i in d.get("bad_samples") or ()],
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Report:
        with open(path, encoding="utf-8") as fh:
            try:
                d = json.load(fh)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)} is not a JSON report: {e}") from None
        return cls.from_dict(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False, default=_plain)

    def to_text(self) -> str:
        return text(self)

    def to_html(self) -> str:
        return html(self)

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write by suffix (``.json``, ``.html``, ``.txt``), atomically; returns the path."""
        p = os.fspath(path)
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
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(data)

        return atomic_write(p, suffix, write)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<nanhunt.Report findings={len(self.findings)} first={self.first.module if self.first else None!r}>"

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from rich_renderables(self)


def _plain(o: Any) -> Any:
    if isinstance(o, float):
        return str(o)
    if isinstance(o, (tuple, set)):
        return list(o)
    return str(o)
