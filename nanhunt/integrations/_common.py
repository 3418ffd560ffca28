"""What both training-loop callbacks share: the hunt they own, its report, and closing it."""

from __future__ import annotations

from .._record import Hunt
from .._report import Report


class HuntOwner:
    hunt: Hunt | None = None

    @property
    def report(self) -> Report | None:
        """The current (or last) watch's report; ``None`` before training started."""
        return self.hunt.report if self.hunt is not None else None

    def close(self) -> None:
        """Stop watching; idempotent. Raises a pending ``NonFiniteError`` in raise mode."""
        if self.hunt is not None:
            self.hunt.close()
