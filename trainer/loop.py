"""The single-process training loop: the reference every parallel engine is checked against."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import JobConfig, TrainConfig
from trainer.data import BatchStream, Dataset, data_for
from trainer.device import peak_memory_mb, pick_device
from trainer.models import count_params, recipe_for
from trainer.protocol import MetricsSink, StopSignal, should_stop
from trainer.recipe import ModelRecipe, build_dense


class TrainingError(RuntimeError):
    """A terminal failure of the run itself (NaN loss, ...): retrying will not help."""


def build_optimizer(params: Any, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


@torch.no_grad()
def evaluate(
    model: nn.Module, data: Dataset, *, recipe: ModelRecipe, cfg: TrainConfig, device: torch.device
) -> float:
    """Mean loss over a fixed set of validation batches (same set at every evaluation)."""
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(cfg.seed + 7919)
    total = 0.0
    for _ in range(cfg.eval_batches):
        x, y = recipe.feed(data.batch(split="val", batch_size=cfg.batch_size, generator=g))
        total += recipe.loss(model(x.to(device)), y.to(device)).item()
    model.train(was_training)
    return total / cfg.eval_batches


def report_step(
    sink: MetricsSink, *, step: int, loss: float, seconds: float, tokens: int, device: torch.device
) -> None:
    """The per-step metrics every engine reports, so the dashboard reads one vocabulary."""
    sink.metric(step, "loss", loss)
    sink.metric(step, "step_time_ms", seconds * 1e3)
    sink.metric(step, "tokens_per_s", tokens / seconds)
    sink.metric(step, "peak_mem_mb", peak_memory_mb(device))


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


def resume(directory: Path | None, *, model: nn.Module, opt: torch.optim.Optimizer, sink: MetricsSink) -> int:
    """Load the latest checkpoint in `directory` into model and optimizer; the step to go on from
    (0 when there is none)."""
    if (path := latest_checkpoint(directory)) is None:
        return 0
    state = load_checkpoint(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    start = int(state["step"])
    sink.log(f"resumed from {path.name} at step {start}")
    return start


def train(
    job: JobConfig,
    *,
    sink: MetricsSink,
    stop: StopSignal,
    checkpoint_dir: Path | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Train `job` on one device. Returns the result dict (also sent to `sink.result`)."""
    cfg = job.train
    device = device or pick_device(job.resources.device)
    recipe = recipe_for(job.model)
    model = build_dense(recipe, seed=cfg.seed, device=device)
    opt = build_optimizer(model.parameters(), cfg)
    data = data_for(job)
    stream = BatchStream(data=data, batch_size=cfg.batch_size, seed=cfg.seed)

    start = resume(checkpoint_dir, model=model, opt=opt, sink=sink)
    n_params = count_params(model)
    sink.log(f"model {job.model.kind}: {n_params:,} parameters on {device}")
    sink.event("start", {"params": n_params, "device": str(device), "start_step": start})

    tokens_per_step = cfg.batch_size * job.model.seq_len
    loss_value = val_loss = float("nan")
    steps = StepRange(start=start, end=cfg.steps, stop=stop)
    for step in steps:
        t0 = time.perf_counter()
        x, y = recipe.feed(stream.batch_for(step - 1))
        loss = recipe.loss(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        loss_value = loss.item()  # note: a CPU-GPU sync point, once per step
        check_finite(loss_value, step)
        dt = time.perf_counter() - t0
        report_step(sink, step=step, loss=loss_value, seconds=dt, tokens=tokens_per_step, device=device)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            val_loss = evaluate(model, data, recipe=recipe, cfg=cfg, device=device)
            sink.metric(step, "val_loss", val_loss)
        if checkpoint_dir is not None and job.checkpoint_every and step % job.checkpoint_every == 0:
            p = save_checkpoint(
                checkpoint_dir,
                step=step,
                state={"model": model.state_dict(), "optimizer": opt.state_dict()},
            )
            sink.event("checkpoint", {"step": step, "path": str(p)})

    if checkpoint_dir is not None and steps.ran > 0:
        save_checkpoint(
            checkpoint_dir,
            step=steps.last,
            state={"model": model.state_dict(), "optimizer": opt.state_dict()},
        )
    result = run_summary(
        steps,
        final_loss=loss_value,
        val_loss=val_loss,
        params=n_params,
        tokens_per_step=tokens_per_step,
        device=device,
    )
    sink.result(result)
    return result
