"""The one step loop. `run_steps` owns every loop rule: resume, the batch of each step, the fixed
validation batches, the stop signal and the run summary; what follows a step (metric names,
evaluation and checkpoint cadence) is trainer/after_step.py's, which the selection executor
follows too. The loop is reached through trainer/runner.py's `run`, the trainer's one entry
point. Engines (trainer/engine.py's composed engine for plain, pipeline, tensor,
data-parallel and offloaded runs and their compositions; trainer/spill/job.py's spilling engine)
plug in through `Engine`.

Checkpoints: each checkpoint holds the engine's state plus the loop's own ("loop": last loss, last
val_loss, and at the run's last step the result), so a run resumed with no steps left re-emits the
same `result` and writes no metric. A rank writes its pieces under `checkpoint_dir/<subdir>` (the
engine names it; a single-piece engine writes in checkpoint_dir itself); of the data-parallel
replicas, which hold identical pieces, only the first writes, and every replica resumes from it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from jobrules.applied import APPLIED_FILE
from jobrules.spec import JobSpec, TrainSpec
from trainer.after_step import AfterStep, report_eval, report_step
from trainer.checkpoint import CheckpointError, checkpoint_steps, load_checkpoint, save_checkpoint, set_aside
from trainer.data import BatchStream, Dataset
from trainer.device import peak_memory_mb
from trainer.protocol import MetricsSink, StopSignal, should_stop
from trainer.recipe import ModelRecipe
from trainer.report import NameLimit, Reports, collecting, emit, evaluation

__all__ = ["Engine", "TrainingError", "run_steps"]


class TrainingError(RuntimeError):
    """A terminal failure of the run itself (NaN loss, ...): retrying will not help."""


class Engine(Protocol):
    """What the loop needs from an engine. Every method is called on every rank in the same order
    (an engine may run collectives in any of them); losses come back as the global mean, equal on
    every rank."""

    device: torch.device
    n_params: int
    """The whole model's parameter count."""
    checkpoint_subdir: str | None
    """Where this rank's pieces go under checkpoint_dir (None: checkpoint_dir itself)."""
    writes_checkpoints: bool
    """False on ranks whose pieces another rank writes (data-parallel replicas after the first)."""

    def train_step(self, inputs: Any, targets: Any) -> float: ...

    def eval_loss(self, inputs: Any, targets: Any) -> float: ...

    def step_metrics(self) -> dict[str, float]: ...

    def eval_report(self, step: int, sink: MetricsSink) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...

    def describe(self) -> str: ...

    def start_info(self) -> dict[str, Any]: ...

    def summary(self, *, steps_ran: int, sink: MetricsSink) -> dict[str, Any]: ...

    def close(self) -> None: ...


VAL_SEED_OFFSET = 7919
"""The validation batches come from a generator seeded train.seed + this: the same fixed set at
every evaluation, on every engine."""


def val_batches(data: Dataset, *, recipe: ModelRecipe, cfg: TrainSpec) -> Iterator[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(cfg.seed + VAL_SEED_OFFSET)
    for _ in range(cfg.eval_batches):
        yield recipe.feed(data.batch(split="val", batch_size=cfg.batch_size, generator=g))


def evaluate(engine: Engine, data: Dataset, *, recipe: ModelRecipe, cfg: TrainSpec) -> float:
    """Mean loss over the fixed validation batches."""
    losses = [engine.eval_loss(x, y) for x, y in val_batches(data, recipe=recipe, cfg=cfg)]
    return sum(losses) / len(losses)


class StepRange:
    """The steps start+1 .. end of a run, cut short between steps (on every rank at the same step)
    when a stop is requested. Afterwards `last` is the last step that ran, `stopped` whether a stop
    cut the run short, and `elapsed` the seconds the loop took."""

    def __init__(self, *, start: int, end: int, stop: StopSignal) -> None:
        self.start = start
        self.end = end
        self.last = start
        self.stopped = False
        self._stop = stop
        self._t0: float | None = None
        self._t1: float | None = None

    def __iter__(self) -> Iterator[int]:
        self._t0 = time.perf_counter()
        try:
            for step in range(self.start + 1, self.end + 1):
                if should_stop(self._stop):
                    self.stopped = True
                    return
                yield step
                self.last = step
        finally:
            self._t1 = time.perf_counter()

    @property
    def ran(self) -> int:
        return self.last - self.start

    @property
    def elapsed(self) -> float:
        if self._t0 is None:
            return 0.0
        return (self._t1 or time.perf_counter()) - self._t0


def run_summary(
    steps: StepRange,
    *,
    final_loss: float,
    val_loss: float,
    params: int,
    tokens_per_step: int,
    device: torch.device,
) -> dict[str, Any]:
    """The result every engine returns (engines add their own keys)."""
    return {
        "steps": steps.last,
        "stopped": steps.stopped,
        "final_loss": final_loss,
        "val_loss": val_loss,
        "params": params,
        "tokens_per_s": tokens_per_step * steps.ran / steps.elapsed if steps.elapsed > 0 else 0.0,
        "device": str(device),
    }


def check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise TrainingError(f"loss is {loss} at step {step}; lower train.lr or enable grad_clip")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(mine: int, *, device: torch.device) -> int:
    """The smallest of every rank's `mine` (one all-reduce MIN of a tensor on the engine's device:
    on NCCL a CUDA tensor, as NCCL requires; on gloo a CPU one). Without a process group: `mine`."""
    if not _distributed():
        return mine
    t = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


_NONE_ABOVE = 2**62


def resume(directory: Path | None, *, engine: Engine, sink: MetricsSink) -> tuple[int, dict[str, Any]]:
    """Load the newest checkpoint that EVERY rank can load into the engine; (the step to go on
    from, the loop's saved state). (0, {}) when there is none.

    Each rank writes its own pieces, so one rank's newest file can be damaged (a crash, a bad
    disk) while the others' are fine. The ranks agree on a step in rounds: each loads its newest
    checkpoint at or below the current bound (skipping files that fail to load), and one
    all-reduce MIN makes the smallest of those the next bound; when a round leaves the bound where
    it was, every rank holds that step. Every rank runs the same rounds (the bound is the same on
    all of them), so the collectives pair up; there are at most as many rounds as checkpoints
    kept. A rank whose pieces another writes (a data-parallel replica) only reads."""
    candidates = checkpoint_steps(directory)
    loaded: tuple[int, Path, dict[str, Any]] | None = None
    bound = _NONE_ABOVE
    while True:
        if loaded is not None and loaded[0] > bound:
            loaded = None
        while loaded is None and candidates:  # this rank's newest loadable one within the bound
            step, path = candidates.pop(0)
            if step > bound:
                continue
            try:
                loaded = (step, path, load_checkpoint(path))
            except CheckpointError as e:
                if engine.writes_checkpoints:
                    set_aside(path, f"cannot be loaded ({e})")
        new_bound = _agree(loaded[0] if loaded else 0, device=engine.device)
        if new_bound == bound:
            break
        bound = new_bound
    if bound == 0 or loaded is None:
        return 0, {}
    step, path, state = loaded
    engine.load_state_dict(state)
    sink.log(f"resumed from {path.name} at step {step}")
    return step, dict(state.get("loop", {}))


def _collecting(steps: StepRange, reports: Reports) -> Iterator[int]:
    """The steps, with the user's reports collected while each one runs (not between them)."""
    for step in steps:
        with collecting(reports):
            yield step


def run_steps(
    engine: Engine,
    *,
    job: JobSpec,
    recipe: ModelRecipe,
    data: Dataset,
    sink: MetricsSink,
    stop: StopSignal,
    checkpoint_dir: Path | None,
) -> dict[str, Any]:
    """Train `job` on `engine` from its latest checkpoint to train.steps (or a stop). Returns the
    result dict, also sent to `sink.result` (sinks of ranks other than 0 are silent)."""
    cfg = job.train
    my_dir = checkpoint_dir
    if checkpoint_dir is not None and engine.checkpoint_subdir is not None:
        my_dir = checkpoint_dir / engine.checkpoint_subdir
    start, carried = resume(my_dir, engine=engine, sink=sink)
    if start >= cfg.steps and "result" in carried:
        # the run had already finished (e.g. the worker died before recording it): same result,
        # no new metrics
        sink.log(f"nothing left to run: step {start} of {cfg.steps} was reached before")
        engine.close()
        sink.result(carried["result"])
        return carried["result"]

    sink.log(
        f"model {job.model.kind}: {engine.n_params:,} parameters on {engine.device}; {engine.describe()}"
    )
    sink.event(
        "start",
        {"params": engine.n_params, "device": str(engine.device), "start_step": start, **engine.start_info()},
    )
    stream = BatchStream(data=data, batch_size=cfg.batch_size, seed=cfg.seed)
    loss_value = float(carried.get("final_loss", math.nan))
    val_loss = float(carried.get("val_loss", math.nan))

    def save(step: int, result: dict[str, Any] | None = None) -> Path | None:
        if my_dir is None or not engine.writes_checkpoints:
            return None
        loop_state: dict[str, Any] = {"final_loss": loss_value, "val_loss": val_loss}
        if result is not None:
            loop_state["result"] = result
        # the worker writes the applied step into the job's folder, above a rank's piece
        return save_checkpoint(
            my_dir,
            step=step,
            state={**engine.state_dict(), "loop": loop_state},
            applied_file=checkpoint_dir / APPLIED_FILE if checkpoint_dir is not None else None,
        )

    tokens_per_step = cfg.batch_size * job.model.seq_len
    after = AfterStep.of(job)
    steps = StepRange(start=start, end=cfg.steps, stop=stop)
    # the user's own metrics (trainer/report.py): what the step's code reported, once per name
    reports, names = Reports(), NameLimit()
    for step in _collecting(steps, reports):
        t0 = time.perf_counter()
        inputs, targets = recipe.feed(stream.batch_for(step - 1))
        loss_value = engine.train_step(inputs, targets)
        check_finite(loss_value, step)
        dt = time.perf_counter() - t0
        report_step(
            sink,
            step=step,
            loss=loss_value,
            seconds=dt,
            tokens=tokens_per_step,
            peak_mem_mb=peak_memory_mb(engine.device),
        )
        for name, value in engine.step_metrics().items():
            sink.metric(step, name, value)
        if after.evaluates(step):
            with evaluation(reports):
                val_loss = evaluate(engine, data, recipe=recipe, cfg=cfg)
            report_eval(sink, step=step, val_loss=val_loss)
            engine.eval_report(step, sink)
        emit(sink, step=step, reports=reports, names=names)
        # the last step's checkpoint is written below, with the result in it
        if after.checkpoints(step):
            p = save(step)
            if p is not None:
                sink.event("checkpoint", {"step": step, "path": str(p)})

    result = run_summary(
        steps,
        final_loss=loss_value,
        val_loss=val_loss,
        params=engine.n_params,
        tokens_per_step=tokens_per_step,
        device=engine.device,
    ) | engine.summary(steps_ran=steps.ran, sink=sink)
    if steps.ran > 0:
        save(steps.last, result if steps.last == cfg.steps else None)
    engine.close()
    sink.result(result)
    return result
