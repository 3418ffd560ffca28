"""The options of `watch()`, validated in one place.

`watch()` names every option as a keyword (so `help()`, IDEs and type checkers see them); it
hands them to :meth:`Options.make`, which checks each once and gives a clear error naming the
option. The integrations call it too, so a bad option fails when the callback is made, not
inside ``fit()``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .._files import check_writable, glob_patterns
from .._finding import Finding

__all__ = ["Options", "ON_FIND", "MODES", "MAX_DIST_TIMEOUT"]

ON_FIND = ("raise", "warn", "record", "skip", "breakpoint")
MODES = ("full", "sentinel", "ops")
_MAX_HISTORY = 1_000_000  # steps of per-module statistics: a device ring of this length per module
MAX_DIST_TIMEOUT = 365 * 24 * 3600.0  # seconds: the collectives' timeout must fit a timedelta in milliseconds


@dataclass(frozen=True)
class Options:
    on_find: str | Callable[[Finding], Any] = "raise"
    scaler: Any = None
    ignore: tuple[str, ...] = ()
    history: int = 32
    report: str | None = None  # checked path
    mode: str = "full"
    replay: bool = True
    grad_hooks: bool = False
    optimizer_every: int = 1
    stats_every: int = 10
    bundle: str | None = None  # checked path
    distributed: bool | None = None
    rank: int | None = None
    dist_timeout: float = 300.0
    max_findings: int = 1000
    max_skips: int = 3
    loader: Any = None
    guard_saves: bool = True

    @classmethod
    def check(cls, caller: str, options: dict[str, Any]) -> Options:
        """`make` for an integration: an unknown option is named with ``caller``, not `make`."""
        known = [k for k in inspect.signature(cls.make).parameters if k != "cls"]
        bad = [k for k in options if k not in known]
        if bad:
            raise TypeError(f"{caller}() got an unexpected keyword argument {bad[0]!r}; it takes "
                            f"nanhunt.watch()'s options: {', '.join(known)}")
        return cls.make(**options)

    @classmethod
    def make(
        cls,
        *,
        on_find: str | Callable[[Finding], Any] = "raise",
        scaler: Any = None,
        ignore: Iterable[str] | str = (),
        history: int = 32,
        report: str | os.PathLike[str] | None = None,
        mode: str = "full",
        replay: bool = True,
        grad_hooks: bool = False,
        optimizer_every: int | None = None,
        stats_every: int = 10,
        bundle: str | os.PathLike[str] | None = None,
        distributed: bool | None = None,
        rank: int | None = None,
        dist_timeout: float = 300.0,
        max_findings: int = 1000,
        max_skips: int = 3,
        loader: Any = None,
        guard_saves: bool = True,
    ) -> Options:
        if not (callable(on_find) or on_find in ON_FIND):
            raise ValueError(
                f"on_find must be 'raise', 'warn', 'record', 'skip', 'breakpoint' or a callable taking a Finding; "
                f"got {on_find!r}"
            )
        if callable(on_find):
            _takes_a_finding(on_find)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        patterns = glob_patterns(ignore, "module names")
        _int("history", history, 0, "steps kept", high=_MAX_HISTORY)
        for name, v in (("replay", replay), ("grad_hooks", grad_hooks), ("guard_saves", guard_saves),
                        ("distributed", distributed)):
            if not (isinstance(v, bool) or (name == "distributed" and v is None)):
                raise TypeError(f"{name} must be True or False; got {v!r}")
        if grad_hooks and mode == "sentinel":
            raise ValueError("grad_hooks=True needs mode='full': sentinel mode records no module calls, so there "
                             "is no module's gradient to hook (its hits are localised by a backward replay); "
                             "drop grad_hooks or use mode='full'")
        if optimizer_every is None:  # exact in full mode; sentinel reads the weights every 10 steps
            optimizer_every = 10 if mode == "sentinel" else 1
        _int("optimizer_every", optimizer_every, 0, "0: only on a hit")
        _int("stats_every", stats_every, 1, "sample magnitudes every N steps")
        if scaler is not None and not (hasattr(scaler, "step") and hasattr(scaler, "update")):
            raise TypeError(f"scaler must be a torch.amp.GradScaler; got {type(scaler).__name__}")
        if rank is not None:
            _int("rank", rank, 0, "this process's rank")
        if (isinstance(dist_timeout, bool) or not isinstance(dist_timeout, (int, float))
                or not 0 < dist_timeout <= MAX_DIST_TIMEOUT):
            raise ValueError(f"dist_timeout must be a number of seconds > 0 and <= {MAX_DIST_TIMEOUT:g} (a year); "
                             f"got {dist_timeout!r}")
        _int("max_findings", max_findings, 1, "findings the report keeps")
        _int("max_skips", max_skips, 0, "consecutive skipped steps before NonFiniteError")
        if loader is not None:
            from torch.utils.data import DataLoader

            if not isinstance(loader, DataLoader):
                raise TypeError(f"loader must be a torch.utils.data.DataLoader; got {type(loader).__name__}")
        return cls(
            on_find=on_find, scaler=scaler, ignore=patterns, history=history,
            report=check_writable(report, (".json", ".html", ".txt"), "report") if report is not None else None,
            mode=mode, replay=replay, grad_hooks=grad_hooks or mode == "ops",
            optimizer_every=optimizer_every, stats_every=stats_every,
            bundle=check_writable(bundle, (".pt",), "bundle") if bundle is not None else None,
            distributed=distributed, rank=rank,
            dist_timeout=float(dist_timeout),
            max_findings=max_findings,
            max_skips=max_skips, loader=loader, guard_saves=guard_saves,
        )


def _int(name: str, v: Any, low: int, meaning: str, high: int | None = None) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{name} must be an int {bound} ({meaning}); got {v!r}")


def _takes_a_finding(fn: Callable[..., Any]) -> None:
    """An ``on_find`` callable must take the Finding: said at watch(), not as a TypeError from
    inside the user's step at the first finding (callables without a signature are trusted)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None)
    except TypeError:
        raise ValueError(f"on_find must be a callable taking one argument (the Finding); {fn!r} takes {sig}") from None
