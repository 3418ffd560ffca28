"""The record of one non-finite value: :class:`Finding`, and the error that carries it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["Finding", "NonFiniteError", "PHASES", "CAUSES"]

PHASES = ("forward", "backward", "grad", "optimizer", "check", "checkpoint")
CAUSES = ("created", "input", "parameter", "unknown")


@dataclasses.dataclass(frozen=True)
class Finding:
    """Where one non-finite value was found. Every field is plain data."""

    phase: str
    module: str
    module_type: str
    tensor: str
    step: int
    call: int
    # the first non-finite element, row-major: a sparse tensor's at its dense index
    # (t.to_dense()[index]); a nested tensor's as (component, *index within it), t.unbind()[k][rest],
    # with shape its component count and each dimension's largest size (to_padded_tensor's shape)
    index: tuple[int, ...] | None
    value: float | None
    counts: dict[str, int]
    shape: tuple[int, ...]
    dtype: str
    cause: str
    op: str | None = None
    source: str | None = None
    chain: tuple[str, ...] = ()
    rank: int | None = None
    reproducible: bool | None = None
    hint: str = ""
    # after a reference replay (_locate/differential.py): "numerics", "precision", "compiler",
    # "nondeterministic", "transient"; and what that replay saw (plain data)
    verdict: str | None = None
    reference: dict[str, Any] = dataclasses.field(default_factory=dict)
    samples: tuple[int, ...] = ()  # dataset indices of the batch rows holding NaN/Inf (watch(loader=...))
    evaluation: bool = False  # a forward call in evaluation: the model in eval mode, gradients off

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["index"] = list(self.index) if self.index is not None else None
        d["shape"] = list(self.shape)
        d["chain"] = list(self.chain)
        d["samples"] = list(self.samples)
        d["value"] = _json_float(self.value)
        d["reference"] = {k: _json_float(v) if isinstance(v, float) else v for k, v in self.reference.items()}
        if self.verdict:
            from ._words import remedy

            d["remedy"] = remedy(self)  # words, not a field: from_dict leaves it out
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["index"] = tuple(d["index"]) if d.get("index") is not None else None
        kw["shape"] = tuple(d.get("shape", ()))
        kw["chain"] = tuple(d.get("chain", ()))
        kw["samples"] = tuple(int(i) for i in d.get("samples", ()))
        v = d.get("value")
        kw["value"] = float(v) if v is not None else None
        kw["counts"] = dict(d.get("counts", {}))
        kw["evaluation"] = d.get("evaluation") is True
        kw["reference"] = {k: _from_json_float(v) for k, v in (d.get("reference") or {}).items()}
        f = cls(**kw)
        _check_values(f)
        return f

    @property
    def where(self) -> str:
        """`module` as a person reads it: the model itself is ``<model>``."""
        return self.module if self.module else "<model>"

    def summary(self) -> str:
        """The one-paragraph answer (the `NonFiniteError` message)."""
        from ._words import paragraph

        return paragraph(self)

    def __str__(self) -> str:
        return self.summary()

    def __eq__(self, other: object) -> bool:
        """Field by field, with a NaN value equal to a NaN (a finding's value is NaN more often than
        not: it equals itself, and its copy read back from a report)."""
        if other.__class__ is not self.__class__:
            return NotImplemented
        return _key(self) == _key(other)  # type: ignore[arg-type]

    def __hash__(self) -> int:
        """A finding can be a set member or a dict key (its dicts hashed by their items)."""
        return hash(_key(self))


def _key(f: Finding) -> tuple[Any, ...]:
    return tuple(_plain(getattr(f, x.name)) for x in dataclasses.fields(f))


def _plain(v: Any) -> Any:
    """``v`` as a hashable value that equals another exactly when the two hold the same data."""
    if isinstance(v, float) and math.isnan(v):
        return ("nan",)  # NaN != NaN: one marker for every NaN
    if isinstance(v, dict):
        return ("dict", tuple(sorted(((repr(k), _plain(x)) for k, x in v.items()), key=lambda kv: kv[0])))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_plain(x) for x in v))
    try:
        hash(v)
    except TypeError:
        return ("repr", repr(v))
    return v


PHASES = ("forward", "backward", "grad", "optimizer", "check", "checkpoint")
CAUSES = ("created", "input", "parameter", "unknown")
VERDICTS = (None, "numerics", "precision", "compiler", "nondeterministic", "transient")
_BIG = 2**63  # no count, index or step of a real tensor reaches it
_DIMS = 64  # torch's own limit on a tensor's dimensions


def _check_values(f: Finding) -> None:
    """A finding read back (a report, a bundle, another rank's): values the fields can hold."""
    if f.phase not in PHASES:
        raise ValueError(f"phase {f.phase!r} is none of {', '.join(PHASES)}")
    if f.cause not in CAUSES:
        raise ValueError(f"cause {f.cause!r} is none of {', '.join(CAUSES)}")
    if f.verdict not in VERDICTS:
        raise ValueError(f"verdict {f.verdict!r} is none of {', '.join(str(v) for v in VERDICTS)}")
    if not -1 <= f.step < _BIG or not 0 <= f.call < _BIG:
        raise ValueError(f"step {f.step} / call {f.call} out of range")
    if f.rank is not None and not 0 <= f.rank < _BIG:
        raise ValueError(f"rank {f.rank} out of range")
    for what, dims in (("index", f.index or ()), ("shape", f.shape)):
        if len(dims) > _DIMS or any(not 0 <= int(i) < _BIG for i in dims):
            raise ValueError(f"{what} {dims if len(dims) <= 8 else f'of {len(dims)} dimensions'} is no tensor's")
    for k, n in f.counts.items():
        if k not in ("nan", "+inf", "-inf") or not isinstance(n, int) or not 0 <= n < _BIG:
            raise ValueError(f"counts[{k!r}] = {n!r}: counts are 'nan', '+inf', '-inf' with non-negative numbers")
    if any(not 0 <= i < _BIG for i in f.samples):
        raise ValueError("samples are dataset indices (non-negative)")
    if f.value is not None and math.isfinite(f.value):
        raise ValueError(f"value {f.value!r} is finite: a finding's element is NaN, +inf or -inf")


def _json_float(v: float | None) -> float | str | None:
    if v is None:
        return None
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def _from_json_float(v: Any) -> Any:
    return float(v) if v in ("nan", "inf", "-inf") else v


class NonFiniteError(FloatingPointError):
    """Raised at the first non-finite value when ``on_find="raise"``.

    ``.finding`` is the first :class:`Finding` (of the step that raised it: after a run caught
    one and went on, a later error's finding is that step's; its message does not call it the
    hunt's first), ``.report`` the hunt's :class:`Report`.
    """

    def __init__(self, finding: Finding, report: Any = None, why: str | None = None, first: bool = True) -> None:
        from ._words import paragraph

        text = paragraph(finding, first=first)
        super().__init__(f"{why} {text}" if why else text)
        self.finding = finding
        self._report = report  # (or what makes it, from the hunt as it was when raised: made on first read)
        self.why = why  # why a run that was going on stops now (on_find="skip": max_skips), else None
        self.first = first  # the hunt's first finding (False: a later one, raised after a run went on)

    @property
    def report(self) -> Any:
        if callable(self._report) and not hasattr(self._report, "findings"):
            self._report = self._report()
        return self._report

    @report.setter
    def report(self, value: Any) -> None:
        self._report = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.finding, self.report, self.why, self.first))
