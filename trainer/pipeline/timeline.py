"""Pipeline pieces the composed engine (trainer/engine.py) reports: the executed and simulated
timelines of a step, sent as a `timeline` event at every evaluation. The stages themselves are cut
by trainer/parallelize.py and stepped by trainer/pipeline/driver.py.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from trainer.pipeline.actions import COMPUTE_OPS, Schedule
from trainer.pipeline.simulate import Costs, simulate, summarize


def measured_costs(timeline: list[dict[str, Any]], *, sched: Schedule) -> Costs:
    """Per-stage mean F/B/W durations from an executed timeline; transfer is the smallest observed
    hand-off gap (producer's end to consumer's start), a latency estimate that excludes queueing."""
    spans: dict[tuple[int, str], list[float]] = defaultdict(list)
    ends: dict[tuple[str, int, int, int], float] = {}
    for e in timeline:
        if e["op"] in COMPUTE_OPS:
            spans[(e["stage"], e["op"])].append(e["end"] - e["start"])
            ends[(e["op"], e["mb"], e["stage"], e["replica"])] = e["end"]
    gaps = [
        e["start"] - ends[("F", e["mb"], e["stage"] - 1, e["replica"])]
        for e in timeline
        if e["op"] == "F" and e["stage"] > 0 and ("F", e["mb"], e["stage"] - 1, e["replica"]) in ends
    ]

    def mean(stage: int, op: str) -> float:
        xs = spans.get((stage, op), [])
        return sum(xs) / len(xs) if xs else 0.0

    per_stage = {s: (mean(s, "F"), mean(s, "B"), mean(s, "W")) for s in range(sched.stages)}
    f = [v[0] for v in per_stage.values() if v[0] > 0] or [1.0]
    b = [v[1] + v[2] for v in per_stage.values() if v[1] > 0] or [1.0]
    return Costs(
        forward=sum(f) / len(f),
        backward=sum(b) / len(b),
        transfer=max(0.0, min(gaps, default=0.0)),
        per_stage=per_stage,
    )


def timeline_event(timelines: list[list[dict[str, Any]]], *, sched: Schedule) -> dict[str, Any]:
    executed = sorted((e for tl in timelines for e in tl), key=lambda e: (e["rank"], e["start"]))
    costs = measured_costs(executed, sched=sched)
    sim = simulate(sched, costs)
    return {
        "schedule": sched.name,
        "stages": sched.stages,
        "microbatches": sched.microbatches,
        "executed": executed,
        "simulated": sim.timeline,
        "bubble_executed": summarize(executed, ranks=sched.stages, split=sched.split_backward).bubble,
        "bubble_simulated": sim.bubble,
        "peak_stash_simulated": sim.peak_stash,
    }
