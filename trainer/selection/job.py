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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jobrules.spec import BatchTrial, JobSpec, SelectionBatch, SpecError, parse
from trainer.checkpoint import latest_checkpoint
from trainer.config import load_job
from trainer.protocol import MetricsSink, StopSignal
from trainer.selection.executor import Executor, ExecutorConfig, TrialEntry, uses_processes
from trainer.selection.fused import fusable, refusal
from trainer.selection.fused_batch import FusedGroups
from trainer.selection.fusion_plan import MIN_GAIN, StepCost, measure_fit
from trainer.selection.fusion_plan import Member as PlanMember
from trainer.selection.fusion_plan import plan as make_plan
from trainer.selection.halving import HalvingConfig
from trainer.selection.step_costs import Book


@dataclass(kw_only=True, slots=True)
class TrialSpec:
    index: int
    spec: dict[str, Any]
    warm_start: Path | None = None


@dataclass(kw_only=True, slots=True)
class BatchSpec:
    trials: list[TrialSpec]
    executor: ExecutorConfig
    fuse: bool = True
    """Train fusable trials as stacked models where the plan says it pays
    (trainer/selection/fused_batch.py, trainer/selection/fusion_plan.py)."""


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
    step_costs: Path | None = None,
) -> dict[str, Any]:
    """Train the batch over `devices`; returns the summary with the leaderboard (best first).

    checkpoint_root/trial-<index>/ holds each trial's checkpoints; a trial that finds one there
    resumes from it (so a re-delivered batch continues where it stopped). `more`: asked for the
    trials due now (BatchTrial dicts; none: an empty list) when a device frees and no trial waits
    for one (trainer/selection/executor.py). `step_costs`: the fusion plan's lines this host
    already measured (trainer/selection/step_costs.py; read only, the summary's `fusion.measured`
    says what this run measured)."""
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
    fusion: dict[str, Any] | None = None
    if spec.fuse and entries:
        entries, fusion = _run_fused(
            spec,
            entries,
            results,
            devices=devices,
            stop=stop,
            stop_trials=stop_trials,
            growing=more is not None,
            step_costs=step_costs,
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
        fusion=fusion,
    )


def _run_fused(
    spec: BatchSpec,
    entries: list[TrialEntry],
    results: dict[int, dict[str, Any]],
    *,
    devices: list[torch.device],
    stop: StopSignal,
    stop_trials: Callable[[], set[int]] | None,
    growing: bool,
    step_costs: Path | None,
) -> tuple[list[TrialEntry], dict[str, Any]]:
    """The batch's fused stacks trained (their trials' results into `results`); returns the trials
    left to the executor and the plan's record."""
    groups, placement, rest, fusion = fuse_groups(
        entries,
        growing=growing,
        devices=devices,
        early_stopping=spec.executor.early_stopping is not None,
        book=Book.load(step_costs),
    )
    if groups:
        results.update(
            FusedGroups(
                groups,
                devices=devices,
                cfg=spec.executor,
                stop=stop,
                stop_trials=stop_trials or (lambda: set()),
                placement=placement,
            ).run()
        )
    return rest, fusion


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
    fusion: dict[str, Any] | None = None,
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
        # the fusion plan: each architecture's measured step cost, the stacks and their devices,
        # the estimated makespans fused and unfused, and whether it fused (None: fuse off)
        "fusion": fusion,
    }


def fuse_groups(
    entries: list[TrialEntry],
    *,
    growing: bool,
    devices: list[torch.device],
    early_stopping: bool,
    book: Book | None = None,
) -> tuple[list[list[TrialEntry]], list[int], list[TrialEntry], dict[str, Any]]:
    """The request's `fuse`: the stacks that train as stacked models (a stack of one: a trial the
    plan leaves alone) with each one's device, and the trials that go through the executor, each
    told why on its sink ("not fused: <reason>"), with the plan's record for the summary.

    Which trials can share a stack is `fusable`'s rule (trainer/selection/fused.py); how many
    stacks, how large and where is the cost model's (trainer/selection/fusion_plan.py), from a few
    measured steps (an architecture `book` holds a line for is not measured again); when the plan
    does not beat every trial alone, nothing fuses. With early stopping the rungs rank every trial
    of the batch together, so the batch fuses only when every trial can go through the stacks."""
    book = book if book is not None else Book()
    reasons: dict[int, str] = {}
    """Why each trial that cannot train in a stack is left to the executor."""
    candidates: list[TrialEntry] = []
    for e in entries:
        if growing:
            reasons[e.index] = "the batch grows as it runs (a sampler's), its trials start one by one"
        elif e.warm_start is not None:
            reasons[e.index] = "it starts from another trial's checkpoint (warm_start)"
        elif (found := latest_checkpoint(e.checkpoint_dir)) is not None:
            reasons[e.index] = f"it resumes from its checkpoint {found.name}"
        else:
            candidates.append(e)
    archs: list[list[TrialEntry]] = []
    """Trials that could share a stack, by architecture (one alone: a stack of one, if it fuses)."""
    for g in fusable([e.job for e in candidates]):
        members = [candidates[k] for k in g.members]
        why = refusal(members[0].job)
        if why is not None:
            reasons[members[0].index] = why
        else:
            archs.append(members)
    alone_entries = [e for e in entries if e.index in reasons]

    record: dict[str, Any] = {"fused": False}

    def nothing(why: str) -> tuple[list[list[TrialEntry]], list[int], list[TrialEntry], dict[str, Any]]:
        # a trial whose architecture no other shares: what sets it apart (against another's)
        heads = fusable([a[0].job for a in archs])
        lone = {a[0].index: g.reason for a, g in zip(archs, heads, strict=True) if len(a) == 1 and g.reason}
        for e in entries:
            said = reasons.get(e.index) or lone.get(e.index) or why
            e.sink.log(f"trial {e.index} not fused: {said}")
        record["reason"] = why
        return [], [], sorted(entries, key=lambda e: e.index), record

    if not any(len(a) > 1 for a in archs):
        return nothing("no other trial to fuse with")
    if early_stopping and alone_entries:
        return nothing(
            f"early stopping ranks the whole batch, and trial(s) {sorted(e.index for e in alone_entries)} "
            "cannot train in a stack"
        )
    measured = _measure(archs, devices, book)
    record["costs"] = [None if c is None else c.as_dict() for c in measured]
    # the lines this run measured, for the worker to keep (trainer/selection/step_costs.py), and
    # how many architectures were planned from a kept one
    record["measured"] = list(book.measured)
    record["reused"] = book.reused
    costs = [c for c in measured if c is not None]
    if len(costs) < len(archs):
        probe = costs[0]
        return nothing(
            f"fusion plan: a stack of the cheapest architecture shares {probe.fixed_s * 1e3:.2f} ms "
            f"of a {probe.step_s(1) * 1e3:.2f} ms step ({probe.fixed_s / probe.step_s(1):+.1%}, "
            f"under {MIN_GAIN:.0%}), and larger ones share less of theirs: no fusion"
        )
    members = [
        PlanMember(trial=e.index, steps=e.job.train.steps, arch=a)
        for a, arch in enumerate(archs)
        for e in arch
    ]
    plan = make_plan(members, costs=costs, devices=len(devices))
    record.update(
        fused=plan.fuse,
        stacks=[{"trials": list(s.trials), "device": s.device, "est_s": s.est_s} for s in plan.stacks],
        makespan_s=plan.makespan_s,
        unfused_s=plan.unfused_s,
    )
    if not plan.fuse:
        return nothing(plan.describe())
    by_index = {e.index: e for a in archs for e in a}
    for e in entries:
        e.sink.log(plan.describe())
    for e in alone_entries:
        e.sink.log(f"trial {e.index} not fused: {reasons[e.index]}")
    groups = [[by_index[i] for i in s.trials] for s in plan.stacks]
    placement = [s.device for s in plan.stacks]
    return groups, placement, sorted(alone_entries, key=lambda e: e.index), record


def _measure(archs: list[list[TrialEntry]], devices: list[torch.device], book: Book) -> list[StepCost | None]:
    """Each architecture's step cost (of a lone trial, its own steps alone): the line `book` keeps
    for it, else measured (and added to `book`). The cheapest architecture that could stack comes
    first, measured on the first device: where its stack shares under MIN_GAIN of its step, no
    architecture is looked at further (None) and nothing fuses, because a larger model's own
    arithmetic grows while what a stack shares (the dispatch of the same ops) does not, so its
    share is smaller still. Otherwise the others not kept are measured on the devices at once."""
    costs: list[StepCost | None] = [None] * len(archs)
    stackable = [a for a, arch in enumerate(archs) if len(arch) > 1]
    first = min(stackable, key=lambda a: (_work(archs[a][0].job), a))
    beside = devices[1] if len(devices) > 1 and devices[1].type == devices[0].type else None

    def cost(a: int, device: torch.device, beside: torch.device | None = None) -> StepCost:
        jobs = [e.job for e in archs[a]]
        if (known := book.get(jobs, devices)) is not None:
            return known
        line, size = measure_fit(jobs, device=device, beside=beside)
        book.add(jobs[0], size=size, devices=devices, cost=line)
        return line

    probe = costs[first] = cost(first, devices[0], beside)
    if probe.fixed_s < MIN_GAIN * probe.step_s(1):
        return costs
    for a in range(len(archs)):
        if a != first:
            costs[a] = book.get([e.job for e in archs[a]], devices)
    todo = [a for a in range(len(archs)) if costs[a] is None]
    errors: list[BaseException] = []

    def work(d: int) -> None:
        try:
            for a in todo[d :: len(devices)]:
                costs[a] = cost(a, devices[d])
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(d,), daemon=True) for d in range(min(len(devices), len(todo)))
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return costs


def _work(job: JobSpec) -> int:
    """A member's arithmetic a step, up to a constant: what orders architectures by cost."""
    m = job.model
    return m.layers * m.d_model**2 * m.seq_len * job.train.batch_size


def load_batch(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
