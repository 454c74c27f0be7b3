"""Discrete-event simulation of shard alternation: the makespan a policy gives a batch.

Each trial is a list of shards, each with a forward time, a backward time (the recompute plus the
backward) and the device bytes it needs; a mini-batch runs forward shards 0..S-1 then backward
shards S-1..0, one task per shard. Copies are taken as hidden by double buffering, so a task costs
its compute time. The policy sees each trial's exact per-mini-batch time, as after HYDRA's profiling
pass. Devices may have different budgets; a shard only goes to a device whose ledger it fits.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from trainer.selection.policy import Policy, TrialView
from trainer.selection.reservations import Reservations


@dataclass(kw_only=True, slots=True)
class SimTrial:
    index: int
    fwd_s: list[float]
    """Forward time per shard."""
    bwd_s: list[float]
    """Backward time per shard (recompute from the saved boundary input plus backward)."""
    shard_bytes: list[int]
    steps: int

    def __post_init__(self) -> None:
        n = len(self.fwd_s)
        if not (n >= 1 and len(self.bwd_s) == n and len(self.shard_bytes) == n):
            raise ValueError(
                f"trial {self.index}: fwd_s ({n}), bwd_s ({len(self.bwd_s)}) and shard_bytes "
                f"({len(self.shard_bytes)}) must have one entry per shard, at least one"
            )
        if self.steps < 1:
            raise ValueError(f"trial {self.index}: steps must be >= 1, got {self.steps}")

    @property
    def step_s(self) -> float:
        return sum(self.fwd_s) + sum(self.bwd_s)

    @property
    def work_s(self) -> float:
        return self.step_s * self.steps

    def tasks(self) -> list[tuple[str, int]]:
        """One mini-batch's tasks in order: ("F", 0) .. ("F", S-1), ("B", S-1) .. ("B", 0)."""
        n = len(self.fwd_s)
        return [("F", k) for k in range(n)] + [("B", k) for k in reversed(range(n))]


@dataclass(kw_only=True, slots=True, frozen=True)
class Slot:
    """One task run: which trial, shard and pass, where and when."""

    trial: int
    step: int
    kind: str
    shard: int
    device: int
    start: float
    end: float
    nbytes: int


@dataclass(kw_only=True, slots=True)
class SimResult:
    makespan: float
    trace: list[Slot] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)


def lower_bound(trials: list[SimTrial], *, devices: int) -> float:
    """No schedule beats max(total work / devices, longest trial): a trial runs on one device at a
    time, and the devices can at best share the work evenly."""
    return max(sum(t.work_s for t in trials) / devices, max(t.work_s for t in trials))


def check_fits(trials: list[SimTrial], budgets: list[int | None]) -> None:
    """A trial with a shard larger than every device's budget could never run; refuse it up front."""
    if any(b is None for b in budgets):
        return
    biggest = max(b for b in budgets if b is not None)
    for t in trials:
        for k, nbytes in enumerate(t.shard_bytes):
            if nbytes > biggest:
                raise ValueError(
                    f"trial {t.index}: shard {k} needs {nbytes} bytes but the largest device budget "
                    f"is {biggest} bytes; it could never run"
                )


def simulate(trials: list[SimTrial], *, budgets: list[int | None], policy: Policy) -> SimResult:
    """Run the batch to the end; `budgets` has one entry per device (None: unlimited)."""
    check_fits(trials, budgets)
    ledgers = [Reservations(device=f"sim{d}", budget_bytes=b) for d, b in enumerate(budgets)]
    by_index = {t.index: t for t in trials}
    tasks = {t.index: t.tasks() for t in trials}
    pos = dict.fromkeys(by_index, 0)  # task position within the mini-batch
    step = dict.fromkeys(by_index, 0)  # mini-batches finished
    done_in_step = dict.fromkeys(by_index, 0.0)
    last_dispatch = dict.fromkeys(by_index, -1)
    running: set[int] = set()
    finished: set[int] = set()
    free = list(range(len(budgets)))
    events: list[tuple[float, int, int]] = []  # (end time, device, trial)
    trace: list[Slot] = []
    now = 0.0
    dispatches = 0

    def task_of(i: int) -> tuple[str, int]:
        return tasks[i][pos[i]]

    def view(i: int) -> TrialView:
        t = by_index[i]
        kind, k = task_of(i)
        return TrialView(
            index=i,
            steps_left=t.steps - step[i],
            step_time_s=t.step_s,
            done_in_step_s=done_in_step[i],
            next_shard_bytes=t.shard_bytes[k],
            last_dispatch=last_dispatch[i],
        )

    views = {i: view(i) for i in by_index}  # rebuilt only when a trial's task completes
    while len(finished) < len(trials):
        # serve free devices in index order, so a run is deterministic
        for d in sorted(free):
            idle = [views[i] for i in by_index if i not in running and i not in finished]
            active = [i for i in by_index if i not in finished]
            pick = policy.choose(idle, active=active, free_bytes=ledgers[d].free_bytes())
            if pick is None:
                continue
            i = pick.index
            assert i not in running, f"policy chose trial {i}, which is already running"
            kind, k = task_of(i)
            t = by_index[i]
            cost = t.fwd_s[k] if kind == "F" else t.bwd_s[k]
            ledgers[d].reserve(i, t.shard_bytes[k])
            running.add(i)
            free.remove(d)
            last_dispatch[i] = dispatches
            views[i].last_dispatch = dispatches
            dispatches += 1
            trace.append(
                Slot(
                    trial=i,
                    step=step[i],
                    kind=kind,
                    shard=k,
                    device=d,
                    start=now,
                    end=now + cost,
                    nbytes=t.shard_bytes[k],
                )
            )
            heapq.heappush(events, (now + cost, d, i))
        if not events:
            raise RuntimeError(f"no device can run any of the idle trials {sorted(set(by_index) - finished)}")
        now, d, i = heapq.heappop(events)
        # complete every task that ends at this instant before the next dispatch round
        batch = [(d, i)]
        while events and events[0][0] == now:
            _, d2, i2 = heapq.heappop(events)
            batch.append((d2, i2))
        for d, i in batch:
            ledgers[d].release(i)
            running.discard(i)
            free.append(d)
            t = by_index[i]
            kind, k = task_of(i)
            done_in_step[i] += t.fwd_s[k] if kind == "F" else t.bwd_s[k]
            pos[i] += 1
            if pos[i] == len(tasks[i]):
                pos[i] = 0
                step[i] += 1
                done_in_step[i] = 0.0
                if step[i] == t.steps:
                    finished.add(i)
            if i not in finished:
                views[i] = view(i)
    return SimResult(makespan=now, trace=trace, peak_bytes=[lg.peak_bytes for lg in ledgers])


def random_batch(
    rng: random.Random,
    *,
    trials: int,
    max_shards: int = 4,
    max_steps: int = 20,
    spread: float = 8.0,
) -> list[SimTrial]:
    """A heterogeneous batch: trials differ in size (shard times span `spread`x), shard count and
    mini-batch count, as a search over depth, width and training length does."""
    out = []
    for i in range(trials):
        size = spread ** rng.random()
        shards = rng.randint(1, max_shards)
        fwd = [size * rng.uniform(0.5, 1.5) / shards for _ in range(shards)]
        out.append(
            SimTrial(
                index=i,
                fwd_s=fwd,
                bwd_s=[2.0 * f for f in fwd],  # backward ~ 2x forward (plus the recompute, folded in)
                shard_bytes=[int(1000 * size / shards * rng.uniform(0.5, 1.5)) for _ in range(shards)],
                steps=rng.randint(1, max_steps),
            )
        )
    return out
