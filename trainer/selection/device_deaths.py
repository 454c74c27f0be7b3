"""A device process of a selection batch dies (killed, out of memory): which trials die with it,
and, once no device is left, the rest. The other devices go on."""

from __future__ import annotations

from collections.abc import Iterator

from trainer.selection.trial_ends import Ends
from trainer.selection.trial_run import FINAL, Batch, TrialRun


class DeadDevices:
    def __init__(self, batch: Batch, ends: Ends, *, devices: int) -> None:
        self.batch = batch
        self.ends = ends
        self.dead: list[str | None] = [None] * devices
        """Per device: why its process died (device processes only), or None while it serves."""

    def serves(self, d: int) -> bool:
        return self.dead[d] is None

    def died(self, d: int, run: TrialRun, error: str) -> None:
        """Device d's process is gone while running `run`'s task: fail that trial and every trial
        whose mini-batch (or data) lived there; with no device left, fail the rest too."""
        with self.batch.cond:
            self.dead[d] = error
            self.ends.fail(run, f"DeviceDied: {error}")
            for r in self._live(but=run):
                if r.pinned == d:
                    self.ends.fail(r, f"DeviceDied: {error} (this trial's mini-batch was in that process)")
            if all(self.dead):
                for r in self._live(but=run):
                    if r.holder in (None, d):
                        self.ends.fail(r, f"DeviceDied: no device left ({'; '.join(map(str, self.dead))})")
            self.batch.cond.notify_all()

    def _live(self, *, but: TrialRun) -> Iterator[TrialRun]:
        # lazily: a failure may end others (the rungs' decisions), which are then passed over
        return (r for r in self.batch.runs.values() if r is not but and r.status not in FINAL)
