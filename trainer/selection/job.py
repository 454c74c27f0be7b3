"""Run one model-selection batch: the entry the worker (and `python -m trainer.selection`) calls.

The batch is a SelectionBatch message (jobrules/spec.py: the group's trials, each an index, a
JobSpec and an optional warm-start checkpoint, and the request's metric, mode, scheduler,
early_stopping, seed, checkpoints and fuse, with their defaults and allowed values defined there
once). With `fuse`, the trials that `fusable` stacks train as stacked models
(trainer/selection/fused_batch.py) and the rest go through the executor, each told why.

Each trial reports to its own sink: metrics (loss, val_loss, step_time_ms, tokens_per_s,
peak_mem_mb), events ("trial" with {"status": running | succeeded | stopped_early | stopped |
failed, "steps_done": k}, "checkpoint") and one result. A trial whose spec is bad, or that can never
fit a device, fails alone with the reason; the rest of the batch runs.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jobrules.spec import BatchTrial, SelectionBatch, SpecError, parse
from trainer.checkpoint import latest_checkpoint
from trainer.config import load_job
from trainer.protocol import MetricsSink, StopSignal
from trainer.selection.executor import Executor, ExecutorConfig, TrialEntry, uses_processes
from trainer.selection.fused import fusable
from trainer.selection.fused_batch import FusedGroups
from trainer.selection.halving import HalvingConfig


@dataclass(kw_only=True, slots=True)
class TrialSpec:
    index: int
    spec: dict[str, Any]
    warm_start: Path | None = None


@dataclass(kw_only=True, slots=True)
class BatchSpec:
    trials: list[TrialSpec]
    executor: ExecutorConfig
    fuse: bool = False
    """Train fusable trials as stacked models (trainer/selection/fused_batch.py)."""


def parse_batch(batch: Any) -> BatchSpec:
    """Check the batch message (SelectionBatch, jobrules/spec.py: the worker builds the same
    model); raises SpecError naming each field and its rule. Trial specs are checked per trial
    at run time, so one bad trial does not sink the batch."""
    msg = parse(SelectionBatch, batch)
    trials = [
        TrialSpec(index=t.index, spec=t.spec, warm_start=Path(t.warm_start) if t.warm_start else None)
        for t in msg.trials
    ]
    es = msg.early_stopping
    rungs = None
    if es is not None:
        rungs = HalvingConfig(
            kind=es.kind,
            reduction_factor=es.reduction_factor,
            min_steps=es.min_steps,
            mode=msg.mode,
            seed=msg.seed,
        )
    budget_mb = msg.device_budget_mb
    cfg = ExecutorConfig(
        scheduler=msg.scheduler,
        metric=msg.metric,
        mode=msg.mode,
        early_stopping=rungs,
        checkpoints=msg.checkpoints,
        prefetch=msg.prefetch,
        device_budget_bytes=None if budget_mb is None else int(budget_mb * 2**20),
    )
    return BatchSpec(trials=trials, executor=cfg, fuse=msg.fuse)


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
    more: Callable[[], list[dict[str, Any]]] | None = None,
    device_threads: bool = False,
    chunk_tasks: int | None = None,
) -> dict[str, Any]:
    """Train the batch over `devices`; returns the summary with the leaderboard (best first).

    checkpoint_root/trial-<index>/ holds each trial's checkpoints; a trial that finds one there
    resumes from it (so a re-delivered batch continues where it stopped). `more`: asked for the
    trials due now (BatchTrial dicts; none: an empty list) when a device frees and no trial waits
    for one (trainer/selection/executor.py)."""
    spec = parse_batch(batch)
    _device_options(spec.executor, devices, device_threads=device_threads, chunk_tasks=chunk_tasks)
    failed: dict[int, dict[str, Any]] = {}

    def entry(t: TrialSpec) -> TrialEntry | None:
        sink = sink_for_trial(t.index)
        try:
            job = load_job(t.spec)
        except (SpecError, TypeError, ValueError) as e:
            reason = f"bad spec: {e}"
            sink.log(f"trial {t.index} failed: {reason}")
            sink.event("trial", {"status": "failed", "steps_done": 0})
            failed[t.index] = {"trial": t.index, "status": "failed", "steps": 0, "error": reason}
            sink.result(failed[t.index])
            return None
        return TrialEntry(
            index=t.index,
            job=job,
            sink=sink,
            checkpoint_dir=checkpoint_root / f"trial-{t.index}" if checkpoint_root is not None else None,
            warm_start=t.warm_start,
        )

    def next_entries() -> list[TrialEntry]:
        assert more is not None
        while got := more():
            out = []
            for raw in got:
                t = BatchTrial.model_validate(raw)
                ws = Path(t.warm_start) if t.warm_start else None
                if (e := entry(TrialSpec(index=t.index, spec=t.spec, warm_start=ws))) is not None:
                    out.append(e)
            if out:
                return out
            # bad specs failed alone (their lines are out before the next ask): ask again
        return []

    entries = [e for t in spec.trials if (e := entry(t)) is not None]
    t0 = time.perf_counter()
    results: dict[int, dict[str, Any]] = {}
    if spec.fuse and entries:
        groups, entries = fuse_groups(entries, growing=more is not None)
        if groups:
            results.update(
                FusedGroups(
                    groups,
                    devices=devices,
                    cfg=spec.executor,
                    stop=stop,
                    stop_trials=stop_trials or (lambda: set()),
                ).run()
            )
    fused = set(results)
    ex = None
    if entries or more is not None:
        ex = Executor(
            entries,
            devices=devices,
            cfg=spec.executor,
            stop=stop,
            stop_trials=stop_trials,
            more=next_entries if more is not None else None,
        )
        results.update(ex.run())
    results.update(failed)
    return _summary(
        spec.executor,
        results,
        fused=fused,
        checkpoint_root=checkpoint_root,
        devices=devices,
        makespan_s=time.perf_counter() - t0,
        ex=ex,
    )


def _device_options(
    cfg: ExecutorConfig, devices: list[torch.device], *, device_threads: bool, chunk_tasks: int | None
) -> None:
    """The caller's choices of how the devices run, set on the batch's executor config."""
    if device_threads:  # CPU devices as threads of this process (see ExecutorConfig.device_processes)
        cfg.device_processes = False
    if chunk_tasks is not None:  # a lone trial's tasks an order (ExecutorConfig.chunk_tasks)
        if not uses_processes(cfg, devices):
            # chunks exist only where a device is a process of its own: refused, not ignored
            raise SpecError(
                "chunk_tasks: applies to CPU device processes only (two or more CPU devices, "
                f"without device threads); this batch runs its {len(devices)} {devices[0].type} "
                "device(s) as threads"
            )
        cfg.chunk_tasks = chunk_tasks


def _summary(
    cfg: ExecutorConfig,
    results: dict[int, dict[str, Any]],
    *,
    fused: set[int],
    checkpoint_root: Path | None,
    devices: list[torch.device],
    makespan_s: float,
    ex: Executor | None,
) -> dict[str, Any]:
    """The batch's summary with its leaderboard (best first). `fused`: the trials that trained
    stacked; `ex`: the executor that ran the others, if one ran."""
    sign = 1.0 if cfg.mode == "min" else -1.0
    ranked = sorted(
        (r for r in results.values() if r.get("best_metric") is not None),
        key=lambda r: (sign * r["best_metric"], r["trial"]),
    )
    if fused and checkpoint_root is not None and cfg.checkpoints == "best":
        # the executor keeps its own trials' best; with fused trials beside them, the batch's best
        # is known only now (the same rule: best metric, then index)
        best = ranked[0]["trial"] if ranked else None
        for i in results:
            if i != best:
                shutil.rmtree(checkpoint_root / f"trial-{i}", ignore_errors=True)
    return {
        "trials": [results[i] for i in sorted(results)],
        "leaderboard": [
            {"trial": r["trial"], "best_metric": r["best_metric"], "status": r["status"], "steps": r["steps"]}
            for r in ranked
        ],
        "best_trial": ranked[0]["trial"] if ranked else None,
        "metric": cfg.metric,
        "mode": cfg.mode,
        "scheduler": cfg.scheduler,
        "devices": [str(d) for d in devices],
        "makespan_s": makespan_s,
        # per device: seconds with no trial to run before the batch's end, and of those the ones
        # spent asking the worker for a trial (a sampler's batch); what a growing batch's ask rule
        # costs shows here (bench.peer --search reads it)
        "idle_s": list(ex.idle_s) if ex is not None else None,
        "ask_s": list(ex.ask_s) if ex is not None else None,
        # when the run reached each phase (Unix seconds; Executor.marks, and `main` when run as
        # `python -m trainer.selection`): the worker logs them with its own at the group's end
        "marks": ex.marks if ex is not None else {},
    }


def fuse_groups(
    entries: list[TrialEntry], *, growing: bool
) -> tuple[list[list[TrialEntry]], list[TrialEntry]]:
    """The request's `fuse`: the groups of two or more trials that train as one stacked model
    (trainer/selection/fused.py `fusable`), and the trials that go through the executor, each told
    why on its sink ("not fused: <reason>")."""
    alone: list[TrialEntry] = []
    candidates: list[TrialEntry] = []
    for e in entries:
        why = None
        if growing:
            why = "the batch grows as it runs (a sampler's), its trials start one by one"
        elif e.warm_start is not None:
            why = "it starts from another trial's checkpoint (warm_start)"
        elif (found := latest_checkpoint(e.checkpoint_dir)) is not None:
            why = f"it resumes from its checkpoint {found.name}"
        if why is None:
            candidates.append(e)
        else:
            e.sink.log(f"trial {e.index} not fused: {why}")
            alone.append(e)
    groups: list[list[TrialEntry]] = []
    for g in fusable([e.job for e in candidates]):
        members = [candidates[k] for k in g.members]
        if g.fused:
            groups.append(members)
        else:
            e = members[0]
            e.sink.log(f"trial {e.index} not fused: {g.reason}")
            alone.append(e)
    alone.sort(key=lambda e: e.index)
    return groups, alone


def load_batch(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
