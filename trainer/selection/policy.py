"""Which idle trial a free device runs next: Sharded-LRTF, FIFO, round-robin and sequential.

Shard alternation (HYDRA): any free device takes the next shard of any idle trial; a trial runs on
at most one device at a time. The executor and the discrete-event simulator both ask a policy here,
so the decisions measured in the simulation are the decisions the executor makes.

A policy only chooses. Who is idle (not running anywhere, not waiting at an ASHA rung, not done)
and whether the chosen shard fits the device's ledger are the caller's facts, passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(kw_only=True, slots=True)
class TrialView:
    """What a policy sees of one trial."""

    index: int
    steps_left: int
    """Mini-batches left, counting the one in progress."""
    step_time_s: float
    """Seconds per mini-batch: measured (mean of the mini-batches done) or, before the first one
    finishes, the caller's estimate."""
    done_in_step_s: float = 0.0
    """Work already done inside the mini-batch in progress."""
    next_shard_bytes: int = 0
    """Device bytes the trial's next shard needs."""
    last_dispatch: int = -1
    """Dispatch counter of the trial's last shard; -1 if it never ran."""

    @property
    def remaining_s(self) -> float:
        return self.step_time_s * self.steps_left - self.done_in_step_s


class Policy(Protocol):
    name: str

    def choose(
        self, idle: Sequence[TrialView], *, active: Sequence[int], free_bytes: int | None
    ) -> TrialView | None:
        """The trial whose next shard the free device runs, or None to leave the device idle.

        idle: trials ready for their next shard; active: indices of the trials that are idle or
        running (not paused at an ASHA rung, not finished); free_bytes: what the device's ledger has
        left (None: no budget).
        """
        ...


def _fitting(idle: Sequence[TrialView], free_bytes: int | None) -> list[TrialView]:
    return [t for t in idle if free_bytes is None or t.next_shard_bytes <= free_bytes]


class _FirstBy:
    """The idle trial that fits and comes first by the policy's `order`."""

    def order(self, t: TrialView) -> tuple[float, ...]:
        raise NotImplementedError

    def choose(
        self, idle: Sequence[TrialView], *, active: Sequence[int], free_bytes: int | None
    ) -> TrialView | None:
        fit = _fitting(idle, free_bytes)
        return min(fit, key=self.order) if fit else None


class ShardedLRTF(_FirstBy):
    """Longest remaining time first: per-mini-batch time x mini-batches left, ties to the lowest
    index. Starting the longest trial early is what keeps the makespan near max(work / devices,
    longest trial): the longest trial is the one that would otherwise finish last, alone."""

    name = "shard-lrtf"

    def order(self, t: TrialView) -> tuple[float, ...]:
        return (-t.remaining_s, t.index)


class FIFO(_FirstBy):
    """Submission order: the lowest-index idle trial."""

    name = "fifo"

    def order(self, t: TrialView) -> tuple[float, ...]:
        return (t.index,)


class RoundRobin(_FirstBy):
    """The idle trial that has waited longest since its last shard (never-run trials first)."""

    name = "round-robin"

    def order(self, t: TrialView) -> tuple[float, ...]:
        return (t.last_dispatch, t.index)


class Sequential:
    """One trial at a time, in index order: the baseline without alternation. Every other device
    stays idle because a trial runs on at most one device. A trial paused at an ASHA rung lets the
    next one run until the rung decides."""

    name = "sequential"

    def choose(
        self, idle: Sequence[TrialView], *, active: Sequence[int], free_bytes: int | None
    ) -> TrialView | None:
        if not active:
            return None
        head = min(active)
        for t in _fitting(idle, free_bytes):
            if t.index == head:
                return t
        return None


POLICIES: dict[str, type] = {cls.name: cls for cls in (ShardedLRTF, FIFO, RoundRobin, Sequential)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"scheduler must be one of {', '.join(POLICIES)}, got {name!r}") from None
