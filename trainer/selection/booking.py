"""Booking a selection trial's finished task: its timings and trace slot; at a mini-batch end its
metrics, evaluation, ranked metric and checkpoint (the same rules as the one loop, after_step.py);
then, as the device hands the trial back, whether it ends, pauses at a rung or goes on."""

from __future__ import annotations

import math
import traceback
from typing import Any

from jobrules.user_metrics import is_user_metric
from trainer.after_step import AfterStep, report_eval, report_step
from trainer.report import emit
from trainer.selection.devices import Done
from trainer.selection.timing import StepTimes
from trainer.selection.trial_ends import Ends
from trainer.selection.trial_run import FINAL, Batch, Slot, TrialRun


class Booking:
    def __init__(self, batch: Batch, ends: Ends, *, costs: StepTimes) -> None:
        self.batch = batch
        self.cfg = batch.cfg
        self.ends = ends
        self.costs = costs

    def done(self, d: int, run: TrialRun, task: Any, done: Done) -> bool:
        """Book one task's Done (outside the lock; device d holds the trial): its timings and slot,
        at a mini-batch end the metrics, evaluation and checkpoint; a failure fails the trial.
        Returns whether the trial goes on."""
        if done.ran:
            run.compute_s += done.compute_s
            run.copy_s += done.copy_s
            run.done_in_step_s += done.compute_s + done.copy_s
            with self.batch.cond:
                self.batch.trace.append(
                    Slot(
                        trial=run.index,
                        device=d,
                        kind=task.kind,
                        shard=task.shard,
                        start=done.start,
                        end=done.end,
                        compute_s=done.compute_s,
                        copy_s=done.copy_s,
                    )
                )
        if done.reports:
            run.reports.merge(done.reports)
        try:
            if done.ran and run.trial.pos == 0:  # the mini-batch is done: metrics, evaluation, checkpoint
                self._end_of_step(run, done)
        except Exception as exc:  # noqa: BLE001 - this trial fails, the batch goes on
            done.error = done.error or f"{type(exc).__name__}: {exc}"
            done.trace = done.trace or traceback.format_exc()
        if done.error is not None:
            with self.batch.cond:
                self.ends.fail(run, done.error, done.trace)
            return False
        return True

    def _end_of_step(self, run: TrialRun, done: Done) -> None:
        t = run.trial
        step = t.step
        cfg = t.job.train
        run.step_times.append(run.done_in_step_s)
        sink = run.sink
        report_step(
            sink,
            step=step,
            loss=t.loss,
            seconds=run.done_in_step_s,
            tokens=cfg.batch_size * t.job.model.seq_len,
            peak_mem_mb=done.peak_bytes / 2**20,
        )
        run.done_in_step_s = 0.0
        if done.val_loss is not None:
            run.compute_s += done.eval_s
            run.val_loss = done.val_loss
            report_eval(sink, step=step, val_loss=run.val_loss)
            if self.cfg.metric == "val_loss":
                self._record(run, run.val_loss)
        if done.error is not None:  # the evaluation failed
            return
        values = emit(sink, step=step, reports=run.reports, names=run.names)
        if self.cfg.metric == "loss":
            self._record(run, t.loss)
        elif self.cfg.metric in values:
            self._record(run, values[self.cfg.metric])
        ckpt = run.entry.checkpoint_dir
        # the last step's checkpoint is Ends.finish's
        if ckpt is not None and AfterStep.of(t.job).checkpoints(step):
            sink.event("checkpoint", {"step": step, "path": str(t.save(ckpt))})

    def _record(self, run: TrialRun, value: float) -> None:
        run.last_metric = value
        if run.best_metric is None or (
            value < run.best_metric if self.cfg.mode == "min" else value > run.best_metric
        ):
            run.best_metric = value

    def hand_back(self, run: TrialRun) -> None:
        """Under the lock: the device hands the trial back; ASHA's decision at a mini-batch end."""
        run.holder = None
        if run.status in FINAL:  # failed inside the task, or ended while it ran
            self.ends.release(run)
            return
        t = run.trial
        if t.pos != 0:
            return
        self.costs.measure(self.batch.runs.values())
        if t.step >= t.steps_total:
            self.ends.finish(run, "succeeded")
            return
        if run.stop_requested:
            self.ends.finish(run, "stopped")
            return
        rungs = self.batch.rungs
        if rungs is not None and rungs.is_rung(run.index, t.step):
            value = run.last_metric if run.last_metric is not None else self._unreported(t.loss)
            run.status = "paused"
            self.ends.apply(rungs.report(run.index, step=t.step, value=value))

    def _unreported(self, loss: float) -> float:
        """A rung's value for a trial with no metric yet: its loss for a built-in metric, the worst
        value there is for a user's own (a trial that never reports it ranks last)."""
        if not is_user_metric(self.cfg.metric):
            return loss
        return math.inf if self.cfg.mode == "min" else -math.inf
