"""Where fusion pays: stack sizes and their devices for the shortest makespan, from a cost model.

The cost model, per architecture (trials that `fusable` lets share a stack): one fused step of a
stack of k members takes

    t(k) = fixed_s + member_s * k

seconds. `fixed_s` is what a stack shares (kernel launches, the interpreter's dispatch, the
optimizer's loop: what fusion saves); `member_s` is each member's own arithmetic. A stack whose
members run s_1 >= s_2 >= ... >= s_k steps costs sum_i (s_i - s_(i+1)) * t(i) (a member that ends
leaves the stack). `measure` fits the line through timed steps of throwaway stacks built from the
trials' own specs (their training starts afresh afterwards, so nothing measured touches a result):
t(1) and t(2), then, where that line leaves fusion something to save, t(1) and t(m) (m: the
largest stack the group could make, at most MEASURE_MAX), the sizes on two devices at once where
the batch has two. On a CPU device it counts the thread's CPU time, which a machine shared with
other processes leaves comparable where the wall time is not. A line is measured once per host:
the worker keeps it for the later groups and batches of the same architecture
(trainer/selection/step_costs.py).

The plan: for every architecture, every split into s stacks of near-equal sizes (s = 1: one stack,
s = n: every trial alone); the stacks go to the devices longest first, each to the least loaded
device (LPT); the plan with the shortest makespan wins, fewer stacks on a tie. Fusion is used only
when that makespan beats the trials run alone (every trial a single, LPT over the devices, the
same estimate) by at least MIN_GAIN: the estimate is a measurement on a machine others share, and
a default that is slower than no fusion is a bug, so a tie goes to no fusion.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jobrules.spec import JobSpec

MIN_GAIN = 0.05
"""Fuse only when the plan's makespan is at least this fraction below the unfused estimate."""
MEASURE_MAX = 8
"""The largest stack measured; larger ones are extrapolated along the fitted line."""
MEASURE_STEPS = 2
"""Timed steps per measured size (after one warm-up step each); the fastest is kept: a slower step
measures the machine's other work (caches, memory bandwidth), not the stack."""
MAX_PLANS = 4096
"""Split combinations tried exhaustively; past this, each architecture is split on its own."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StepCost:
    """The fitted line t(k) = fixed_s + member_s * k of one architecture (seconds per step)."""

    fixed_s: float
    member_s: float

    def __post_init__(self) -> None:
        if self.member_s < 0 or self.fixed_s + self.member_s <= 0:
            raise ValueError(
                f"a step cost must grow with its members and be positive at k=1: fixed_s "
                f"{self.fixed_s}, member_s {self.member_s}"
            )

    @classmethod
    def fit(cls, *, single_s: float, stack_s: float, size: int) -> StepCost:
        """Through t(1) = single_s and t(size) = stack_s (size >= 2)."""
        if size < 2:
            raise ValueError(f"a fit needs a stack of 2 or more, got {size}")
        member = max(0.0, (stack_s - single_s) / (size - 1))
        return cls(fixed_s=single_s - member, member_s=member)

    def step_s(self, k: int) -> float:
        return self.fixed_s + self.member_s * k

    def stack_s(self, steps: Sequence[int]) -> float:
        """A stack whose members run `steps` steps each: t(k) while k members are left."""
        order = sorted(steps, reverse=True)
        total, below = 0.0, 0
        for k in range(len(order), 0, -1):
            total += (order[k - 1] - below) * self.step_s(k)
            below = order[k - 1]
        return total

    def as_dict(self) -> dict[str, float]:
        return {"fixed_s": self.fixed_s, "member_s": self.member_s}


@dataclass(kw_only=True, slots=True, frozen=True)
class Member:
    trial: int
    """The caller's key for the trial (a batch index)."""
    steps: int
    arch: int
    """Which architecture (an index into the costs)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Stack:
    trials: tuple[int, ...]
    device: int
    est_s: float


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    stacks: tuple[Stack, ...]
    """Every trial in exactly one stack (a stack of one: the trial alone); by device, in order."""
    makespan_s: float
    unfused_s: float
    """The same estimate with every trial alone."""
    fuse: bool
    """The plan beats every trial alone by MIN_GAIN or more."""

    @property
    def gain(self) -> float:
        return 1.0 - self.makespan_s / self.unfused_s if self.unfused_s > 0 else 0.0

    def describe(self) -> str:
        sizes = ", ".join(f"{len(s.trials)}@dev{s.device}" for s in self.stacks)
        verdict = "fuse" if self.fuse else f"no fusion (gain under {MIN_GAIN:.0%})"
        return (
            f"fusion plan: stacks {sizes}; estimated makespan {self.makespan_s:.2f} s vs "
            f"{self.unfused_s:.2f} s unfused ({self.gain:+.1%}): {verdict}"
        )


def split(members: Sequence[Member], parts: int) -> list[list[Member]]:
    """`members` into `parts` stacks of near-equal sizes, longest trials dealt first so each stack
    holds trials of about the same length (a short member leaves its stack early)."""
    order = sorted(members, key=lambda m: (-m.steps, m.trial))
    out: list[list[Member]] = [[] for _ in range(parts)]
    for i, m in enumerate(order):
        out[i * parts // len(order)].append(m)
    return out


def lpt(loads: Sequence[float], devices: int) -> tuple[list[int], float]:
    """Longest processing time first: each job to the least loaded device. Returns each job's
    device and the makespan."""
    where = [0] * len(loads)
    busy = [0.0] * devices
    for j in sorted(range(len(loads)), key=lambda j: (-loads[j], j)):
        d = min(range(devices), key=lambda d: (busy[d], d))
        where[j] = d
        busy[d] += loads[j]
    return where, max(busy, default=0.0)


def _place(groups: list[list[Member]], costs: Sequence[StepCost], devices: int) -> tuple[list[Stack], float]:
    loads = [costs[g[0].arch].stack_s([m.steps for m in g]) for g in groups]
    where, makespan = lpt(loads, devices)
    stacks = [
        Stack(trials=tuple(m.trial for m in g), device=d, est_s=load)
        for g, d, load in zip(groups, where, loads, strict=True)
    ]
    stacks.sort(key=lambda s: (s.device, -s.est_s, s.trials))
    return stacks, makespan


def plan(members: Sequence[Member], *, costs: Sequence[StepCost], devices: int) -> Plan:
    """The shortest-makespan stacks of `members` over `devices` (see the module docstring)."""
    if devices < 1:
        raise ValueError(f"a plan needs at least one device, got {devices}")
    archs: dict[int, list[Member]] = {}
    for m in members:
        archs.setdefault(m.arch, []).append(m)
    keys = sorted(archs)
    alone = [[m] for m in members]
    _, unfused = _place(alone, costs, devices)
    choices = [range(1, len(archs[a]) + 1) for a in keys]
    best: tuple[float, int, list[Stack]] | None = None
    if math.prod(len(c) for c in choices) <= MAX_PLANS:
        combos: list[tuple[int, ...]] = list(itertools.product(*choices))
    else:
        # too many to try: each architecture's split as if it had the devices to itself
        combos = [tuple(_best_alone(archs[a], costs, devices) for a in keys)]
    for parts in combos:
        groups = [g for a, s in zip(keys, parts, strict=True) for g in split(archs[a], s)]
        stacks, makespan = _place(groups, costs, devices)
        score = (makespan, len(stacks))
        if best is None or score < best[:2]:
            best = (makespan, len(stacks), stacks)
    assert best is not None or not members
    if best is None:
        return Plan(stacks=(), makespan_s=0.0, unfused_s=0.0, fuse=False)
    makespan, _, stacks = best
    fuse = any(len(s.trials) > 1 for s in stacks) and makespan <= (1.0 - MIN_GAIN) * unfused
    return Plan(stacks=tuple(stacks), makespan_s=makespan, unfused_s=unfused, fuse=fuse)


def _best_alone(members: list[Member], costs: Sequence[StepCost], devices: int) -> int:
    return min(range(1, len(members) + 1), key=lambda s: (_place(split(members, s), costs, devices)[1], s))


# -- measuring ---------------------------------------------------------------------------------


def measure(jobs: Sequence[JobSpec], *, device: torch.device, beside: torch.device | None = None) -> StepCost:
    """`measure_fit`'s line."""
    return measure_fit(jobs, device=device, beside=beside)[0]


def measure_fit(
    jobs: Sequence[JobSpec], *, device: torch.device, beside: torch.device | None = None
) -> tuple[StepCost, int]:
    """Fit the step cost of `jobs`' architecture (fusable jobs) on `device` from steps of throwaway
    stacks: first one member and two; where that line leaves fusion something to save (a shared
    part of at least MIN_GAIN of a single's step) and the jobs make a larger stack, the line is
    fitted again through one member and min(len(jobs), MEASURE_MAX). So an architecture whose step
    is its members' own arithmetic (one CPU thread, a compute-bound model) costs the batch a few
    steps of one and two members, and a launch-bound one (a small model on a GPU) is measured at
    the size it would run. `beside`: a second device of the same kind, which times the larger
    stacks while `device` times the single, at once. One job: t(k) = k * t(1). Returns the line
    and the stack size it was fitted at (1, 2 or the larger one: what a line kept for later
    batches is keyed by, trainer/selection/step_costs.py)."""
    from trainer.selection.fused import FusedTrials

    size = min(len(jobs), MEASURE_MAX)
    if size < 1:
        raise ValueError("measuring a stack's cost needs a job")

    def fastest(k: int, dev: torch.device, out: dict[int, float]) -> None:
        # on a CPU device whose ops run on this thread (one torch thread per device, as a batch
        # over several CPU devices sets it) the thread's CPU time is the stack's work whatever
        # else the cores run; elsewhere (a GPU, or torch's own threads) the synchronised wall time
        on_thread = dev.type == "cpu" and torch.get_num_threads() == 1
        clock = time.thread_time if on_thread else time.perf_counter
        stack = FusedTrials(list(jobs[:k]), device=dev)
        times = []
        for i in range(MEASURE_STEPS + 1):
            _sync(dev)
            t0 = clock()
            stack.train_step(check=False)
            _sync(dev)
            if i:  # the first step warms up (allocations, lazy inits)
                times.append(clock() - t0)
        out[k] = min(times)

    def pair(k: int) -> StepCost:
        """t(1) and t(k), fitted: at once on the two devices (both under the same load), or one
        after the other on one."""
        t: dict[int, float] = {}
        if beside is None:
            fastest(1, device, t)
            fastest(k, device, t)
        else:
            other = threading.Thread(target=fastest, args=(k, beside, t), daemon=True)
            other.start()
            fastest(1, device, t)
            other.join()
            if k not in t:
                raise RuntimeError(f"measuring a stack of {k} on {beside} failed (its error is above)")
        return StepCost.fit(single_s=t[1], stack_s=t[k], size=k)

    if size == 1:
        t: dict[int, float] = {}
        fastest(1, device, t)
        return StepCost(fixed_s=0.0, member_s=t[1]), 1
    cost = pair(2)
    if size > 2 and cost.fixed_s >= MIN_GAIN * cost.step_s(1):
        return pair(size), size
    return cost, 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
