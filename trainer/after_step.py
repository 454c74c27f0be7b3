"""What happens after a training step, for every way a step is run: the one loop
(trainer/loop.py's `run_steps`) and the selection executor (trainer/selection/executor.py), which
steps many trials shard by shard and so cannot use the loop itself. Both report the same metric
names and evaluate and checkpoint on the same steps, so a trial's series reads like a job's.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobrules.spec import JobSpec
from trainer.protocol import MetricsSink

STEP_METRICS = ("loss", "step_time_ms", "tokens_per_s", "peak_mem_mb")
"""The per-step metrics every engine reports, so the dashboard reads one vocabulary."""
VAL_METRIC = "val_loss"


@dataclass(frozen=True, slots=True, kw_only=True)
class AfterStep:
    """A job's cadence: which steps evaluate and which write a checkpoint."""

    steps: int
    """The run's last step."""
    eval_every: int
    checkpoint_every: int
    """0: no checkpoint between steps."""

    @classmethod
    def of(cls, job: JobSpec) -> AfterStep:
        return cls(
            steps=job.train.steps, eval_every=job.train.eval_every, checkpoint_every=job.checkpoint_every
        )

    def evaluates(self, step: int) -> bool:
        # the last step always evaluates, so every run ends with a val_loss
        return step % self.eval_every == 0 or step == self.steps

    def checkpoints(self, step: int) -> bool:
        # the last step's checkpoint is the end-of-run one (with the result in the loop's), written
        # by the caller once the run is over, never twice
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0 and step != self.steps


def report_step(
    sink: MetricsSink, *, step: int, loss: float, seconds: float, tokens: int, peak_mem_mb: float
) -> None:
    """The STEP_METRICS of one step."""
    values = (loss, seconds * 1e3, tokens / max(seconds, 1e-9), peak_mem_mb)
    for name, value in zip(STEP_METRICS, values, strict=True):
        sink.metric(step, name, value)


def report_eval(sink: MetricsSink, *, step: int, val_loss: float) -> None:
    sink.metric(step, VAL_METRIC, val_loss)
