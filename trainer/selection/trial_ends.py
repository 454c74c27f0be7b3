"""How a trial of a selection batch ends: its status, last checkpoint, result and final event; the
checkpoint policy over the ended trials; the rungs' decisions that end or resume others; and the
release of an ended trial's memory."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any, Protocol

import torch

from jobrules.stopping import StopReason
from jobrules.user_metrics import is_user_metric
from trainer.selection.halving import Decisions
from trainer.selection.trial_run import FINAL, Batch, Status, TrialRun


class Ended(Protocol):
    """A trial as its result tells how it ended: a TrialRun, or a member of a fused stack."""

    val_loss: float
    last_metric: float | None
    best_metric: float | None
    stop_reason: StopReason | None
    error: str | None

    @property
    def status(self) -> str: ...


def how_it_ended(run: Ended, metric: str) -> dict[str, Any]:
    """A trial's result fields from `val_loss` to `error`, alone or fused (Ends.result)."""
    return {
        "val_loss": run.val_loss,
        "metric": metric,
        "last_metric": run.last_metric,
        "best_metric": run.best_metric,
        "stopped_early": run.status == "stopped_early",
        "stop_reason": None if run.stop_reason is None else run.stop_reason.as_dict(),
        "error": run.error,
    }


class Ends:
    """Under the batch's lock: a trial ends (succeeded, stopped, stopped early or failed)."""

    def __init__(self, batch: Batch, *, forget: Callable[[int], None]) -> None:
        self.batch = batch
        self.cfg = batch.cfg
        self._forget = forget
        """Called with a released trial's index: the device processes that hold it drop it."""
        self._kept: int | None = None
        """Checkpoints `best`: the ended trial whose checkpoints are kept so far."""

    def finish(self, run: TrialRun, status: Status) -> None:
        if status == "succeeded" and run.best_metric is None and is_user_metric(self.cfg.metric):
            # it would rank nowhere: a failure that says why
            self.fail(
                run,
                f"MetricNotReported: the batch ranks by {self.cfg.metric!r}, which this trial's code "
                f"never reported (trainer.report.report({self.cfg.metric!r}, value))",
            )
            return
        run.status = status
        t = run.trial
        steps = t.step if t is not None else 0
        ckpt = run.entry.checkpoint_dir
        if t is not None and ckpt is not None and steps > 0 and self.cfg.checkpoints != "none":
            path = t.save(ckpt)
            run.sink.event("checkpoint", {"step": steps, "path": str(path)})
        self._ended(run, steps)

    def fail(self, run: TrialRun, error: str, trace: str = "") -> None:
        """The trial ends failed with `error` ("Type: message"); `trace` goes to its log."""
        run.error = error
        run.sink.log(f"trial {run.index} failed: {run.error}\n{trace}")
        run.status = "failed"
        self._ended(run, run.trial.step if run.trial else 0)

    def _ended(self, run: TrialRun, steps: int) -> None:
        self._report_end(run, steps)
        self._keep_checkpoints(run)
        self.release(run)
        if self.batch.rungs is not None:
            self.apply(self.batch.rungs.finished(run.index, step=steps))

    def release(self, run: TrialRun) -> None:
        """An ended trial's weights and optimizer state go (its result keeps its step and loss),
        in this process and, with device processes, in every device process that holds it (its
        shared block is unmapped there at the device's next dispatch), so memory follows the
        trials that run, however many the batch asks or ends. Nothing runs an ended trial again
        (rungs promote only paused trials). A trial still held by a device (its task running) is
        released when the device hands it back. With device threads, only a growing batch
        releases (its process lives as long as the batch)."""
        t = run.trial
        b = self.batch
        if t is None or run.released or run.holder is not None or not (b.grows or b.processes):
            return
        run.released = True
        t.shards, t.model = [], torch.nn.Sequential()
        t._inputs.clear()
        t._y = t._grad = t._coef = None
        t._norms.clear()
        run.block = None
        self._forget(run.index)

    def _report_end(self, run: TrialRun, steps: int) -> None:
        """The trial's result, then its final event (both say why it stopped)."""
        result = self.result(run)
        run.sink.result(result)
        data: dict[str, Any] = {"status": run.status, "steps_done": steps}
        if run.stop_reason is not None:
            data["stop_reason"] = result["stop_reason"]
        if run.error is not None:
            data["error"] = run.error
        run.sink.event("trial", data)

    def _keep_checkpoints(self, run: TrialRun) -> None:
        """Apply the checkpoint policy to an ended trial: `none` removes its directory, `best`
        keeps only the best ended trial's (by the leaderboard's rule), `all` keeps every one."""
        policy = self.cfg.checkpoints
        if policy == "all" or run.entry.checkpoint_dir is None:
            return
        if policy == "best" and run.best_metric is not None:
            kept = self.batch.runs[self._kept] if self._kept is not None else None
            sign = 1.0 if self.cfg.mode == "min" else -1.0
            if kept is None or (sign * run.best_metric, run.index) < (sign * kept.best_metric, kept.index):
                self._kept = run.index
                run = kept  # the previous best loses its place
            if run is None:
                return
        shutil.rmtree(run.entry.checkpoint_dir, ignore_errors=True)

    def apply(self, decisions: Decisions) -> None:
        """The rungs' decisions: promoted trials go on, stopped ones end early."""
        for i in decisions.promoted:
            run = self.batch.runs[i]
            if run.status == "paused":
                run.status = "running"
        for i in decisions.stopped:
            run = self.batch.runs[i]
            if run.status not in FINAL:
                run.stop_reason = decisions.reasons.get(i)
                self.finish(run, "stopped_early")

    def result(self, run: TrialRun) -> dict[str, Any]:
        t = run.trial
        return {
            "trial": run.index,
            "status": run.status,
            "steps": t.step if t else 0,
            "final_loss": t.loss if t else float("nan"),
            **how_it_ended(run, self.cfg.metric),
            "compute_s": run.compute_s,
            "copy_s": run.copy_s,
            "busy_s": run.busy_s,
            "overhead_s": run.dispatch_s + run.busy_s - run.compute_s - (run.copy_s - run.prefetch_s),
            "prefetch_s": run.prefetch_s,
        }
