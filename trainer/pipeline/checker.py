"""Proves a schedule runnable: every action present once on the rank that holds its stage, local
order respects inputs, and an in-order execution of all ranks finishes (no deadlock)."""

from __future__ import annotations

from collections import Counter

from trainer.pipeline.schedules import COMPUTE_OPS, Action, Schedule, ScheduleError
from trainer.pipeline.simulate import Costs, deps_of, simulate


def expected_actions(sched: Schedule) -> dict[Action, int]:
    """Every compute action the step needs, mapped to the rank that must run it."""
    ops = ("F", "B", "W") if sched.split_backward else ("F", "B")
    out: dict[Action, int] = {}
    for m in range(sched.microbatches):
        rep = sched.replica_of(m)
        for s in range(sched.stages):
            for op in ops:
                out[Action(op, m, s, rep)] = sched.rank_of(stage=s, replica=rep)
    return out


def check_schedule(sched: Schedule) -> None:
    """Raise ScheduleError naming the first problem found."""
    if len(sched.ranks) != sched.stages:
        raise ScheduleError(f"{sched.name}: {len(sched.ranks)} rank lists for {sched.stages} stages")
    want = expected_actions(sched)
    seen: Counter[Action] = Counter()
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if a.op == "AR":
                continue
            seen[a] += 1
            if a not in want:
                raise ScheduleError(f"{sched.name}: rank {r} has unexpected action {a}")
            if want[a] != r:
                raise ScheduleError(f"{sched.name}: {a} is on rank {r}, its stage lives on rank {want[a]}")
    if dup := [str(a) for a, n in seen.items() if n > 1]:
        raise ScheduleError(f"{sched.name}: actions scheduled twice: {dup[:5]}")
    if missing := [str(a) for a in want if a not in seen]:
        raise ScheduleError(f"{sched.name}: {len(missing)} actions missing, e.g. {missing[:5]}")
    if not sched.dynamic:
        _check_local_order(sched)
    _check_allreduce(sched)
    # an in-order run at unit costs either finishes or names the ranks it is stuck on
    simulate(sched, Costs())


def _check_local_order(sched: Schedule) -> None:
    """Inputs produced on the same rank must come earlier in that rank's list."""
    for r, acts in enumerate(sched.ranks):
        index = {a: i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            if a.op not in COMPUTE_OPS:
                continue
            for d in deps_of(a, stages=sched.stages, split=sched.split_backward):
                if d in index and index[d] > i:
                    raise ScheduleError(f"{sched.name}: rank {r} runs {a} before its input {d}")


def _check_allreduce(sched: Schedule) -> None:
    if sched.replicas == 1:
        if any(a.op == "AR" for acts in sched.ranks for a in acts):
            raise ScheduleError(f"{sched.name}: AR actions in a single-replica schedule")
        return
    last = "W" if sched.split_backward else "B"
    for r, acts in enumerate(sched.ranks):
        ars = [a for a in acts if a.op == "AR"]
        if sorted((a.stage, a.replica) for a in ars) != sorted(sched.stages_on(r)):
            raise ScheduleError(f"{sched.name}: rank {r} must all-reduce {sched.stages_on(r)}, has {ars}")
        for a in ars:
            i = acts.index(a)
            late = [b for b in acts[i:] if b.op == last and (b.stage, b.replica) == (a.stage, a.replica)]
            if late:
                raise ScheduleError(f"{sched.name}: rank {r} all-reduces stage {a.stage} before {late[0]}")
