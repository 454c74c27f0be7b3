"""Policies and the discrete-event simulator: Sharded-LRTF's decisions on a hand-worked batch,
and over many random batches no trial on two devices at once and no device over its budget."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.selection.policy import (
    FIFO,
    RoundRobin,
    Sequential,
    ShardedLRTF,
    TrialView,
    make_policy,
)
from trainer.selection.simulate import SimTrial, lower_bound, random_batch, simulate


def unit(index: int, *, shards: int, steps: int) -> SimTrial:
    return SimTrial(
        index=index, fwd_s=[1.0] * shards, bwd_s=[1.0] * shards, shard_bytes=[1] * shards, steps=steps
    )


def test_lrtf_decisions_match_the_hand_worked_example() -> None:
    # Two devices; every task (one forward or one backward shard) takes 1 s.
    #   A (0): 2 shards, 1 mini-batch  -> tasks F0 F1 B1 B0   -> 4 s of work
    #   B (1): 1 shard,  2 mini-batches -> F0 B0 F0 B0        -> 4 s
    #   C (2): 1 shard,  1 mini-batch  -> F0 B0               -> 2 s
    # Remaining time = per-mini-batch time x mini-batches left - work done in the current one.
    #   t=0  remaining A4 B4 C2: dev0 <- A (tie with B, lower index), dev1 <- B
    #   t=1  A3 B3 C2:           dev0 <- A, dev1 <- B
    #   t=2  A2 B2 C2:           three-way tie, dev0 <- A, dev1 <- B
    #   t=3  A1 B1 C2:           dev0 <- C (longest), dev1 <- A
    #   t=4  A done, B1 C1:      dev0 <- B, dev1 <- C
    #   t=5  all done; makespan 5 = lower bound max(10/2, 4)
    trials = [unit(0, shards=2, steps=1), unit(1, shards=1, steps=2), unit(2, shards=1, steps=1)]
    res = simulate(trials, budgets=[None, None], policy=ShardedLRTF())
    got = [(s.start, s.device, "ABC"[s.trial], f"{s.kind}{s.shard}") for s in res.trace]
    assert got == [
        (0.0, 0, "A", "F0"),
        (0.0, 1, "B", "F0"),
        (1.0, 0, "A", "F1"),
        (1.0, 1, "B", "B0"),
        (2.0, 0, "A", "B1"),
        (2.0, 1, "B", "F0"),
        (3.0, 0, "C", "F0"),
        (3.0, 1, "A", "B0"),
        (4.0, 0, "B", "B0"),
        (4.0, 1, "C", "B0"),
    ]
    assert res.makespan == 5.0 == lower_bound(trials, devices=2)
    # FIFO keeps C waiting behind A and B and finishes a second later
    assert simulate(trials, budgets=[None, None], policy=FIFO()).makespan == 6.0
    # one trial at a time: the sum of the work
    assert simulate(trials, budgets=[None, None], policy=Sequential()).makespan == 10.0


def test_policies_choose_as_documented() -> None:
    idle = [
        TrialView(index=3, steps_left=10, step_time_s=1.0, next_shard_bytes=50, last_dispatch=7),
        TrialView(index=1, steps_left=2, step_time_s=2.0, next_shard_bytes=10, last_dispatch=9),
        TrialView(index=5, steps_left=4, step_time_s=4.0, done_in_step_s=3.0, next_shard_bytes=90),
    ]
    active = [0, 1, 3, 5]
    # remaining: 3 -> 10, 1 -> 4, 5 -> 13
    assert ShardedLRTF().choose(idle, active=active, free_bytes=None).index == 5
    assert ShardedLRTF().choose(idle, active=active, free_bytes=60).index == 3  # 5 does not fit
    assert ShardedLRTF().choose(idle, active=active, free_bytes=5) is None
    assert FIFO().choose(idle, active=active, free_bytes=None).index == 1
    assert RoundRobin().choose(idle, active=active, free_bytes=None).index == 5  # never ran
    assert RoundRobin().choose(idle[:2], active=active, free_bytes=None).index == 3
    assert Sequential().choose(idle, active=active, free_bytes=None) is None  # trial 0 is running
    assert Sequential().choose(idle, active=[1, 3, 5], free_bytes=None).index == 1
    with pytest.raises(ValueError, match="shard-lrtf, fifo, round-robin, sequential"):
        make_policy("lifo")


def test_a_trial_that_fits_no_device_is_refused() -> None:
    big = SimTrial(index=0, fwd_s=[1.0], bwd_s=[1.0], shard_bytes=[101], steps=1)
    with pytest.raises(ValueError, match="shard 0 needs 101 bytes but the largest device budget is 100"):
        simulate([big], budgets=[100, 50], policy=ShardedLRTF())


def check_trace(trials: list[SimTrial], budgets: list[int | None], res) -> None:  # noqa: ANN001
    by_trial = defaultdict(list)
    by_device = defaultdict(list)
    for s in res.trace:
        by_trial[s.trial].append(s)
        by_device[s.device].append(s)
        # the device's budget holds the shard
        assert budgets[s.device] is None or s.nbytes <= budgets[s.device]
    for i, slots in by_trial.items():
        slots.sort(key=lambda s: s.start)
        # never on two devices at once: a trial's slots do not overlap
        for a, b in zip(slots, slots[1:], strict=False):
            assert a.end <= b.start, (i, a, b)
        # forward shards then backward shards, every mini-batch, all of them
        t = trials[i]
        want = [(step, kind, k) for step in range(t.steps) for kind, k in t.tasks()]
        assert [(s.step, s.kind, s.shard) for s in slots] == want
    for slots in by_device.values():
        slots.sort(key=lambda s: s.start)
        for a, b in zip(slots, slots[1:], strict=False):
            assert a.end <= b.start
    assert set(by_trial) == {t.index for t in trials}
    for d, peak in enumerate(res.peak_bytes):
        assert budgets[d] is None or peak <= budgets[d]


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n_trials=st.integers(1, 10),
    n_devices=st.integers(1, 5),
    policy=st.sampled_from(["shard-lrtf", "fifo", "round-robin", "sequential"]),
    tight=st.booleans(),
)
def test_no_trial_on_two_devices_and_no_device_over_budget(
    seed: int, n_trials: int, n_devices: int, policy: str, tight: bool
) -> None:
    rng = random.Random(seed)
    trials = random_batch(rng, trials=n_trials, max_shards=4, max_steps=4)
    biggest = max(max(t.shard_bytes) for t in trials)
    # tight: heterogeneous budgets, some smaller than the largest shard (only one device must hold it)
    budgets: list[int | None] = [
        biggest if d == 0 or not tight else rng.randint(biggest // 3 + 1, biggest) for d in range(n_devices)
    ]
    res = simulate(trials, budgets=budgets, policy=make_policy(policy))
    check_trace(trials, budgets, res)
    assert res.makespan >= lower_bound(trials, devices=n_devices) - 1e-9
    assert res.makespan <= sum(t.work_s for t in trials) + 1e-9


def test_lrtf_is_near_the_bound_on_random_batches() -> None:
    # not a timing: the simulated makespan is a pure function of the batch
    rng = random.Random(0)
    for _ in range(20):
        trials = random_batch(rng, trials=16, max_shards=4, max_steps=20)
        lrtf = simulate(trials, budgets=[None] * 4, policy=ShardedLRTF()).makespan
        assert lrtf <= 1.10 * lower_bound(trials, devices=4)
