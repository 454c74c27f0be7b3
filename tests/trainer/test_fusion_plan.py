"""The fusion plan (trainer/selection/fusion_plan.py): stack sizes and devices for the shortest
makespan from a step-cost model, and no fusion where it would not pay. Pure arithmetic, except the
last test, which measures a tiny model's stacks for real."""

from __future__ import annotations

import pytest
import torch

from trainer.config import load_job
from trainer.selection.fusion_plan import MIN_GAIN, Member, StepCost, lpt, measure, plan

SHALLOW, DEEP = 0, 1


def grid(*, shallow: int = 4, deep: int = 4, steps: int = 100) -> list[Member]:
    """bench.peer's grid: trials 0..3 shallow, 4..7 deep (twice the cost a step)."""
    return [Member(trial=i, steps=steps, arch=SHALLOW) for i in range(shallow)] + [
        Member(trial=shallow + i, steps=steps, arch=DEEP) for i in range(deep)
    ]


def test_the_fit_goes_through_both_measured_points() -> None:
    c = StepCost.fit(single_s=0.010, stack_s=0.016, size=4)
    assert c.step_s(1) == pytest.approx(0.010) and c.step_s(4) == pytest.approx(0.016)
    # a member that leaves early: 2 members for 10 steps, then 1 for 20 more
    assert c.stack_s([30, 10]) == pytest.approx(10 * c.step_s(2) + 20 * c.step_s(1))
    with pytest.raises(ValueError, match="member_s"):
        StepCost(fixed_s=0.0, member_s=-1.0)


def test_stacks_are_balanced_across_devices() -> None:
    """Fusing saves half a single's step: one stack per architecture (the plan before this one)
    puts all the deep work on one device; two stacks of two of each, one of each per device, finish
    sooner."""
    costs = [StepCost(fixed_s=0.004, member_s=0.004), StepCost(fixed_s=0.008, member_s=0.008)]
    p = plan(grid(), costs=costs, devices=2)
    assert p.fuse
    loads = [sum(s.est_s for s in p.stacks if s.device == d) for d in range(2)]
    assert max(loads) == pytest.approx(p.makespan_s)
    # one stack per architecture (shallow on one device, deep on the other) is worse than this
    by_arch = max(costs[SHALLOW].stack_s([100] * 4), costs[DEEP].stack_s([100] * 4))
    assert p.makespan_s < by_arch
    assert max(loads) / min(loads) < 1.2
    assert sorted(len(s.trials) for s in p.stacks) == [2, 2, 2, 2]
    assert sorted(t for s in p.stacks for t in s.trials) == list(range(8))


def test_a_stack_is_split_when_a_whole_one_leaves_a_device_idle() -> None:
    """Eight trials of one architecture on two devices: one stack of eight idles a device; two
    stacks of four, one each, finish sooner."""
    members = grid(shallow=8, deep=0)
    p = plan(members, costs=[StepCost(fixed_s=0.010, member_s=0.005)], devices=2)
    assert p.fuse
    assert sorted(len(s.trials) for s in p.stacks) == [4, 4]
    assert {s.device for s in p.stacks} == {0, 1}


def test_a_trial_is_left_alone_when_that_balances_the_devices() -> None:
    """Three trials on two devices: a stack of two on one device and the third alone on the
    other beats a stack of three (one device idle) and three singles."""
    members = grid(shallow=3, deep=0)
    p = plan(members, costs=[StepCost(fixed_s=0.010, member_s=0.005)], devices=2)
    assert p.fuse
    assert sorted(len(s.trials) for s in p.stacks) == [1, 2]
    assert {s.device for s in p.stacks} == {0, 1}


def test_no_fusion_when_a_stack_costs_what_its_members_do() -> None:
    """t(k) = k * t(1) (one CPU thread on a compute-bound model): stacking saves nothing, so
    nothing fuses, however the trials are grouped."""
    costs = [StepCost(fixed_s=0.0, member_s=0.017), StepCost(fixed_s=0.0, member_s=0.031)]
    p = plan(grid(), costs=costs, devices=2)
    assert not p.fuse and p.makespan_s == pytest.approx(p.unfused_s)
    assert "no fusion" in p.describe()


def test_no_fusion_when_the_gain_is_under_the_margin() -> None:
    """A saving smaller than MIN_GAIN is within what a shared machine's measurement can be off by."""
    saved = MIN_GAIN / 4
    costs = [StepCost(fixed_s=saved * 0.010, member_s=(1 - saved) * 0.010)]
    p = plan(grid(shallow=8, deep=0), costs=costs, devices=2)
    assert not p.fuse and 0 < p.gain < MIN_GAIN


def test_members_of_different_lengths_stack_with_their_like() -> None:
    """Long trials stack with long ones: a short member leaves its stack early."""
    members = [Member(trial=i, steps=100 if i < 2 else 10, arch=0) for i in range(4)]
    p = plan(members, costs=[StepCost(fixed_s=0.010, member_s=0.001)], devices=1)
    stacks = {tuple(sorted(s.trials)) for s in p.stacks}
    assert stacks == {(0, 1, 2, 3)} or stacks == {(0, 1), (2, 3)}


def test_lpt_places_the_longest_first() -> None:
    where, makespan = lpt([5.0, 3.0, 3.0, 2.0], 2)
    assert makespan == pytest.approx(7.0) and where[0] != where[1]


def test_measure_fits_a_line_from_real_steps() -> None:
    base = {
        "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 2, "seq_len": 8},
        "data": {"max_chars": 20_000},
        "train": {"steps": 4, "batch_size": 4},
    }
    jobs = [load_job({**base, "train": {**base["train"], "lr": 1e-3 * (i + 1)}}) for i in range(3)]
    c = measure(jobs, device=torch.device("cpu"))
    assert c.member_s >= 0 and c.step_s(1) > 0
    assert c.step_s(3) >= c.step_s(1)
