"""A selection batch that grows as it runs (a sampler's: workers/search.py): once a trial has
ended since `more` was last asked, one free device asks it (outside the lock; the other devices go
on) for the trials due now and adds those it returns to the run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.selection.trial_run import Batch, BuildError, TrialEntry, TrialRun


@dataclass(kw_only=True, slots=True, eq=False)
class Growth:
    """Under the batch's lock: whether to ask `more`, and the asking."""

    batch: Batch
    more: Callable[[], list[TrialEntry]] | None
    cut: Callable[[TrialRun], BuildError | None]
    """Builds a trial on the host (touches only that trial: runs outside the lock)."""
    join: Callable[[TrialRun, BuildError | None], None]
    """Adds a built trial to the run (under the lock)."""
    _asking: bool = field(default=False, init=False)
    _asked_at: int = field(default=-1, init=False)
    """How many trials had ended when `more` last answered None (-1: never asked)."""

    def may_ask(self) -> bool:
        """Whether this free device should ask `more` now."""
        return (
            self.more is not None
            and not self._asking
            and not self.batch.stopping
            and self._asked_at != self.batch.ended()
        )

    def growing(self) -> bool:
        """Whether `more` may still add a trial (it is being asked, or a trial ended since it last
        had none)."""
        if self.more is None:
            return False
        return self._asking or (not self.batch.stopping and self._asked_at != self.batch.ended())

    def ask(self) -> None:
        """Ask for the trials due now (the lock is released while `more` answers and the trials
        are built); none means none now."""
        assert self.more is not None
        cond = self.batch.cond
        self._asking = True
        ended = self.batch.ended()
        cond.release()
        built: list[tuple[TrialRun, BuildError | None]] = []
        try:
            got = self.more()
            for entry in got:
                run = TrialRun(entry=entry)
                built.append((run, self.cut(run)))
        finally:
            cond.acquire()
            self._asking = False
            cond.notify_all()
        if not built:
            self._asked_at = ended
            return
        for run, exc in built:
            self.join(run, exc)
