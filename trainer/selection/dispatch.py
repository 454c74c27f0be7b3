"""Which trial a free device runs next: the trial policy (trainer/selection/policy.py)
over the idle trials, those that paused trials wait for first; the chosen trial is held by that
device until it hands it back."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.selection.policy import Policy, TrialView
from trainer.selection.reservations import Reservations
from trainer.selection.timing import StepTimes
from trainer.selection.trial_run import Batch, TrialRun


@dataclass(kw_only=True, slots=True, eq=False)
class Dispatcher:
    """Under the batch's lock: the idle trials a device may take, and the one it takes."""

    batch: Batch
    policy: Policy
    reservations: list[Reservations]
    """Per device, the policy's plan of its bytes (what a choice may still fit in)."""
    costs: StepTimes
    _dispatches: int = field(default=0, init=False)

    def idle(self, d: int) -> list[TrialRun]:
        return [
            r
            for r in self.batch.runs.values()
            if r.status in ("pending", "running")
            and r.holder is None
            and r.pinned in (None, d)
            and not (r.stop_requested and r.trial.pos == 0)  # stops at the next poll instead
        ]

    def _view(self, run: TrialRun) -> TrialView:
        t = run.trial
        return TrialView(
            index=run.index,
            steps_left=t.steps_total - t.step,
            step_time_s=self.costs.step_time(run),
            done_in_step_s=run.done_in_step_s,
            next_shard_bytes=t.work_bytes[t.next_task.shard],
            last_dispatch=run.last_dispatch,
        )

    def pick(self, d: int, *, exclude: TrialRun | None = None) -> TrialRun | None:
        """The trial device d takes (now held by it), or None when none may run there now."""
        idle = [r for r in self.idle(d) if r is not exclude]
        if not idle:
            return None
        runs = self.batch.runs
        active = [r.index for r in runs.values() if r.status in ("pending", "running")]
        free = self.reservations[d].free_bytes()
        choice = None
        if self.batch.rungs is not None:
            # trials that paused ones wait for go first (the policy still chooses among them)
            urgent = self.batch.rungs.blocking()
            first = [self._view(r) for r in idle if r.index in urgent]
            if first:
                choice = self.policy.choose(first, active=active, free_bytes=free)
        if choice is None:
            choice = self.policy.choose([self._view(r) for r in idle], active=active, free_bytes=free)
        if choice is None:
            return None
        run = runs[choice.index]
        assert run.holder is None, f"trial {run.index} is already held by device {run.holder}"
        run.holder = d
        run.last_dispatch = self._dispatches
        self._dispatches += 1
        return run
