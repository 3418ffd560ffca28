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

    def _resume_at(self, step: int) -> None:
        """A resumed run: the trainer's step counter starts past 0 (restored from a checkpoint), and
        findings are numbered as its steps are, also before the watch's first step."""
        hunt = self.hunt
        if hunt is not None and not hunt.closed and hunt.step == 0 and not hunt.findings and step > 0:
            hunt.step = int(step)

    def close(self) -> None:
        """Stop watching; idempotent. Raises a pending ``NonFiniteError`` in raise mode."""
        if self.hunt is not None:
            self.hunt.close()
