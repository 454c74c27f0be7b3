"""Run one model-selection batch: the entry the worker (and `python -m trainer.selection`) calls.

    batch = {
        "trials": [{"index": 0, "spec": {...JobSpec...}, "warm_start": "/path/ckpt-dir"?}, ...],
        "metric": "val_loss", "mode": "min",
        "scheduler": "shard-lrtf" | "fifo" | "round-robin" | "sequential",
        "early_stopping": {"kind": "asha" | "sha" | "hyperband", "reduction_factor": 3,
                           "min_steps": 10} | None,
        "seed": 0,                       # orders the rungs' decisions (trainer/selection/halving.py)
        "checkpoints": "best" | "all" | "none",
        "prefetch": true, "device_budget_mb": null,        # optional
    }

Each trial reports to its own sink: metrics (loss, val_loss, step_time_ms, tokens_per_s,
peak_mem_mb), events ("trial" with {"status": running | succeeded | stopped_early | stopped |
failed, "steps_done": k}, "checkpoint") and one result. A trial whose spec is bad, or that can never
fit a device, fails alone with the reason; the rest of the batch runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError, JobConfig
from trainer.protocol import MetricsSink, StopSignal
from trainer.selection.executor import Executor, ExecutorConfig, TrialEntry
from trainer.selection.halving import KINDS, HalvingConfig
from trainer.selection.scheduler import SCHEDULERS

BATCH_KEYS = {
    "trials",
    "metric",
    "mode",
    "scheduler",
    "early_stopping",
    "seed",
    "checkpoints",
    "prefetch",
    "device_budget_mb",
}
# keys the service may keep in the batch document that the executor does not act on
IGNORED_KEYS = {"id", "name", "base", "space", "method", "devices"}


@dataclass(kw_only=True, slots=True)
class TrialSpec:
    index: int
    spec: dict[str, Any]
    warm_start: Path | None = None


@dataclass(kw_only=True, slots=True)
class BatchSpec:
    trials: list[TrialSpec]
    executor: ExecutorConfig


def parse_batch(batch: dict[str, Any]) -> BatchSpec:
    """Check the batch document; raises ConfigError naming the field and the rule. Trial specs are
    checked per trial at run time, so one bad trial does not sink the batch."""
    if not isinstance(batch, dict):
        raise ConfigError("the batch must be an object")
    unknown = set(batch) - BATCH_KEYS - IGNORED_KEYS
    if unknown:
        raise ConfigError(f"batch has unknown keys {sorted(unknown)}; known: {sorted(BATCH_KEYS)}")
    raw_trials = batch.get("trials")
    if not isinstance(raw_trials, list) or not raw_trials:
        raise ConfigError("batch.trials must be a non-empty list of {index, spec}")
    trials = []
    for n, t in enumerate(raw_trials):
        if (
            not isinstance(t, dict)
            or not isinstance(t.get("index"), int)
            or not isinstance(t.get("spec"), dict)
        ):
            raise ConfigError(f"batch.trials[{n}] must be an object with an integer index and a spec object")
        ws = t.get("warm_start")
        trials.append(TrialSpec(index=t["index"], spec=t["spec"], warm_start=Path(ws) if ws else None))
    indices = [t.index for t in trials]
    if len(set(indices)) != len(indices):
        raise ConfigError(f"batch.trials indices must be unique, got {indices}")
    scheduler = batch.get("scheduler") or "shard-lrtf"
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"batch.scheduler must be one of {', '.join(SCHEDULERS)}, got {scheduler!r}")
    mode = batch.get("mode") or "min"
    metric = batch.get("metric") or "val_loss"
    seed = batch.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"batch.seed must be an integer, got {seed!r}")
    rungs = None
    es = batch.get("early_stopping")
    if es is not None:
        if not isinstance(es, dict) or es.get("kind") not in KINDS:
            raise ConfigError(
                f"batch.early_stopping must be null or {{'kind': {' | '.join(KINDS)}, ...}}, got {es!r}"
            )
        extra = set(es) - {"kind", "reduction_factor", "min_steps"}
        if extra:
            raise ConfigError(f"batch.early_stopping has unknown keys {sorted(extra)}")
        try:
            rungs = HalvingConfig(
                kind=es["kind"],
                reduction_factor=int(es.get("reduction_factor", 3)),
                min_steps=int(es.get("min_steps", 1)),
                mode=mode,
                seed=seed,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from e
    budget_mb = batch.get("device_budget_mb")
    try:
        cfg = ExecutorConfig(
            scheduler=scheduler,
            metric=metric,
            mode=mode,
            early_stopping=rungs,
            checkpoints=batch.get("checkpoints") or "best",
            prefetch=bool(batch.get("prefetch", True)),
            device_budget_bytes=None if budget_mb is None else int(float(budget_mb) * 2**20),
        )
    except ValueError as e:
        raise ConfigError(f"batch: {e}") from e
    return BatchSpec(trials=trials, executor=cfg)


class _Bad:
    """Stands in for a trial whose spec does not parse; the executor fails it with the reason."""


def run_selection(
    batch: dict[str, Any],
    *,
    sink_for_trial: Callable[[int], MetricsSink],
    stop: StopSignal,
    devices: list[torch.device],
    checkpoint_root: Path | None,
    stop_trials: Callable[[], set[int]] | None = None,
) -> dict[str, Any]:
    """Train the batch over `devices`; returns the summary with the leaderboard (best first).

    checkpoint_root/trial-<index>/ holds each trial's checkpoints; a trial that finds one there
    resumes from it (so a re-delivered batch continues where it stopped)."""
    spec = parse_batch(batch)
    entries: list[TrialEntry] = []
    failed: dict[int, dict[str, Any]] = {}
    for t in spec.trials:
        sink = sink_for_trial(t.index)
        try:
            job = JobConfig.from_dict(t.spec)
        except (ConfigError, TypeError, ValueError) as e:
            reason = f"bad spec: {e}"
            sink.log(f"trial {t.index} failed: {reason}")
            sink.event("trial", {"status": "failed", "steps_done": 0})
            failed[t.index] = {"trial": t.index, "status": "failed", "steps": 0, "error": reason}
            sink.result(failed[t.index])
            continue
        entries.append(
            TrialEntry(
                index=t.index,
                job=job,
                sink=sink,
                checkpoint_dir=checkpoint_root / f"trial-{t.index}" if checkpoint_root is not None else None,
                warm_start=t.warm_start,
            )
        )
    t0 = time.perf_counter()
    results: dict[int, dict[str, Any]] = dict(failed)
    if entries:
        ex = Executor(entries, devices=devices, cfg=spec.executor, stop=stop, stop_trials=stop_trials)
        results.update(ex.run())
    makespan = time.perf_counter() - t0
    sign = 1.0 if spec.executor.mode == "min" else -1.0
    ranked = sorted(
        (r for r in results.values() if r.get("best_metric") is not None),
        key=lambda r: (sign * r["best_metric"], r["trial"]),
    )
    return {
        "trials": [results[i] for i in sorted(results)],
        "leaderboard": [
            {"trial": r["trial"], "best_metric": r["best_metric"], "status": r["status"], "steps": r["steps"]}
            for r in ranked
        ],
        "best_trial": ranked[0]["trial"] if ranked else None,
        "metric": spec.executor.metric,
        "mode": spec.executor.mode,
        "scheduler": spec.executor.scheduler,
        "devices": [str(d) for d in devices],
        "makespan_s": makespan,
    }


def load_batch(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
