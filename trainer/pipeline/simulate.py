"""Discrete-event simulation of a pipeline schedule with per-action costs.

Static schedules run each rank's list in order: an action starts when its rank is free and its
inputs exist (a cross-rank input arrives `transfer` after it was produced). The message-driven
policy (`async`) is simulated by the same engine with a different choice rule: a free rank takes,
among the actions whose inputs have arrived, a backward first, else the lowest forward, and stage 0
injects a new micro-batch only while fewer than `cap` are in flight.

The result carries makespan, bubble ratio (idle compute share over all ranks), peak stashed
activations per rank (micro-batch activations held between a forward and the end of its last
backward action), and the timeline in the same shape the driver records.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trainer.pipeline.actions import COMPUTE_OPS, Action, Schedule, ScheduleError, async_cap


@dataclass(kw_only=True, slots=True)
class Costs:
    forward: float = 1.0
    backward: float = 1.0
    """A whole backward. A split schedule's B costs backward - W and its W costs `weight`."""
    weight: float | None = None
    """W's share of `backward` when the schedule splits it; default half."""
    transfer: float = 0.0
    """Latency of one activation or gradient message between ranks."""
    allreduce: float = 0.0
    """Duration of one stage's gradient exchange between Chimera's two copies."""
    per_stage: dict[int, tuple[float, float, float]] | None = None
    """Measured (F, B, W) per stage; overrides the three figures above for that stage."""

    def __post_init__(self) -> None:
        if self.forward <= 0 or self.backward <= 0:
            raise ValueError(f"costs must be > 0, got forward {self.forward}, backward {self.backward}")
        if self.weight is not None and not 0 < self.weight < self.backward:
            raise ValueError(f"weight ({self.weight}) must be in (0, backward={self.backward})")

    def of(self, a: Action, *, split: bool) -> float:
        if self.per_stage is not None and a.stage in self.per_stage:
            f, b, w = self.per_stage[a.stage]
            return {"F": f, "B": b, "W": w}[a.op]
        w = self.weight if self.weight is not None else self.backward / 2
        if a.op == "F":
            return self.forward
        if a.op == "B":
            return self.backward - w if split else self.backward
        if a.op == "W":
            return w
        return self.allreduce


@dataclass(kw_only=True, slots=True)
class SimResult:
    makespan: float
    bubble: float
    busy: list[float]
    """Compute time per rank."""
    peak_stash: list[int]
    timeline: list[dict[str, Any]] = field(default_factory=list)


def deps_of(a: Action, *, stages: int, split: bool) -> list[Action]:
    """The actions whose outputs `a` consumes."""
    if a.op == "F":
        return [Action("F", a.mb, a.stage - 1, a.replica)] if a.stage > 0 else []
    if a.op == "B":
        deps = [Action("F", a.mb, a.stage, a.replica)]
        if a.stage < stages - 1:
            deps.append(Action("B", a.mb, a.stage + 1, a.replica))
        return deps
    if a.op == "W":
        return [Action("B", a.mb, a.stage, a.replica)]
    return []


def simulate(
    sched: Schedule,
    costs: Costs,
    *,
    noise: dict[Action, float] | None = None,
    cap: int | None = None,
) -> SimResult:
    """Time `sched` under `costs`; `noise` multiplies individual action costs (jitter studies).
    Dynamic schedules (`async`) use the message-driven policy with at most `cap` micro-batches
    in flight (default `async_cap(D)`)."""
    D, split = sched.stages, sched.split_backward
    rank_of = {(s, rep): sched.rank_of(stage=s, replica=rep) for s in range(D) for rep in range(2)}
    work = [[a for a in acts if a.op in COMPUTE_OPS] for acts in sched.ranks]
    finish: dict[Action, float] = {}
    start: dict[Action, float] = {}
    owner: dict[Action, int] = {}
    free = [0.0] * D
    pos = [0] * D
    cap = cap if cap is not None else async_cap(D)

    def cost(a: Action) -> float:
        c = costs.of(a, split=split)
        return c * noise.get(a, 1.0) if noise else c

    def arrival(a: Action, r: int) -> float | None:
        t = 0.0
        for d in deps_of(a, stages=D, split=split):
            if d not in finish:
                return None
            hop = costs.transfer if rank_of[(d.stage, d.replica)] != r else 0.0
            t = max(t, finish[d] + hop)
        return t

    # message-driven bookkeeping: forwards run in micro-batch order on every stage (stage 0
    # injects in order and each stage takes the lowest ready forward), so the only forward
    # candidate is the next one; backward candidates are the rank's in-flight micro-batches
    next_f = [sorted((a for a in w if a.op == "F"), key=lambda a: a.mb) for w in work]
    inflight: list[list[Action]] = [[] for _ in range(D)]

    def candidates(r: int) -> list[tuple[float, Action]]:
        if not sched.dynamic:
            if pos[r] == len(work[r]):
                return []
            a = work[r][pos[r]]
            t = arrival(a, r)
            return [] if t is None else [(max(t, free[r]), a)]
        out = []
        for a in inflight[r]:
            t = arrival(a, r)
            if t is not None:
                out.append((max(t, free[r]), a))
        if next_f[r] and (r != 0 or len(inflight[r]) < cap):
            a = next_f[r][0]
            t = arrival(a, r)
            if t is not None:
                out.append((max(t, free[r]), a))
        return out

    total = sum(len(w) for w in work)
    # a rank's best choice changes only when it commits or one of its inputs is produced
    choice: list[tuple[float, Action] | None] = [None] * D
    dirty = set(range(D))
    while len(finish) < total:
        for r in dirty:
            cands = candidates(r)
            if not cands:
                choice[r] = None
                continue
            t = min(c[0] for c in cands)
            # among actions ready at the decision time: backward work first, then lowest mb
            ready = [a for tt, a in cands if tt <= t]
            choice[r] = (t, min(ready, key=lambda a: (a.op == "F", a.mb, a.op)))
        dirty.clear()
        best: tuple[float, int, Action] | None = None
        for r, c in enumerate(choice):
            if c is not None and (best is None or c[0] < best[0]):
                best = (c[0], r, c[1])
        if best is None:
            stuck = {r: str(work[r][pos[r]]) for r in range(D) if pos[r] < len(work[r])}
            raise ScheduleError(f"{sched.name} deadlocks: next actions per rank {stuck}")
        t, r, a = best
        start[a], finish[a] = t, t + cost(a)
        owner[a] = r
        free[r] = finish[a]
        pos[r] += 1
        dirty.add(r)
        if a.op == "F" and a.stage < D - 1:
            dirty.add(rank_of[(a.stage + 1, a.replica)])
        elif a.op == "B" and a.stage > 0:
            dirty.add(rank_of[(a.stage - 1, a.replica)])
        if sched.dynamic:
            if a.op == "F":
                next_f[r].pop(0)
                inflight[r].append(Action("B", a.mb, a.stage, a.replica))
            else:
                inflight[r].remove(a)
    return summarize(_timeline(sched, costs, start=start, finish=finish, owner=owner), ranks=D, split=split)


def _timeline(
    sched: Schedule,
    costs: Costs,
    *,
    start: dict[Action, float],
    finish: dict[Action, float],
    owner: dict[Action, int],
) -> list[dict[str, Any]]:
    """The simulated actions as timeline rows, by rank and start, then each rank's exchanges."""
    timeline = [
        {
            "rank": owner[a],
            "op": a.op,
            "mb": a.mb,
            "stage": a.stage,
            "replica": a.replica,
            "start": start[a],
            "end": finish[a],
        }
        for a in sorted(start, key=lambda a: (owner[a], start[a]))
    ]
    # Chimera's exchanges start once both copies of a stage have their final gradients
    last = "W" if sched.split_backward else "B"
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if a.op != "AR":
                continue
            ends = [finish[b] for b in finish if b.op == last and b.stage == a.stage]
            t0 = max(ends, default=0.0)
            timeline.append(
                {
                    "rank": r,
                    "op": "AR",
                    "mb": -1,
                    "stage": a.stage,
                    "replica": a.replica,
                    "start": t0,
                    "end": t0 + costs.allreduce,
                }
            )
    return timeline


def summarize(timeline: list[dict[str, Any]], *, ranks: int, split: bool) -> SimResult:
    """Makespan, bubble and peak stash from a timeline (simulated or executed)."""
    if not timeline:
        return SimResult(makespan=0.0, bubble=0.0, busy=[0.0] * ranks, peak_stash=[0] * ranks)
    # the pipeline's span is its compute; an exchange still draining after it is not a bubble
    compute = [e for e in timeline if e["op"] in COMPUTE_OPS] or timeline
    t0 = min(e["start"] for e in compute)
    makespan = max(e["end"] for e in compute) - t0
    busy = [0.0] * ranks
    events: list[list[tuple[float, int]]] = [[] for _ in range(ranks)]
    freeing = "W" if split else "B"
    for e in timeline:
        if e["op"] not in COMPUTE_OPS:
            continue
        busy[e["rank"]] += e["end"] - e["start"]
        if e["op"] == "F":
            events[e["rank"]].append((e["start"], 1))
        elif e["op"] == freeing:
            events[e["rank"]].append((e["end"], -1))
    peaks = []
    for ev in events:
        level = peak = 0
        for _, d in sorted(ev):  # at equal times the free (-1) sorts first
            level += d
            peak = max(peak, level)
        peaks.append(peak)
    bubble = 1.0 - sum(busy) / (ranks * makespan) if makespan > 0 else 0.0
    return SimResult(makespan=makespan, bubble=bubble, busy=busy, peak_stash=peaks, timeline=timeline)


def jitter(sched: Schedule, *, spread: float, seed: int) -> dict[Action, float]:
    """A multiplier in [1 - spread, 1 + spread] per compute action, reproducible from `seed`.
    Keyed by action, so a static and a message-driven run of the same work see the same draws."""
    rng = random.Random(seed)
    keys = sorted(
        {a for acts in sched.ranks for a in acts if a.op in COMPUTE_OPS},
        key=lambda a: (a.stage, a.replica, a.mb, a.op),
    )
    return {a: 1.0 + rng.uniform(-spread, spread) for a in keys}


def bubble_1f1b(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def bubble_chimera(stages: int, microbatches: int) -> float:
    return (stages - 2) / (2 * microbatches + stages - 2)
