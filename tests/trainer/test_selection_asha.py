"""ASHA promotes and stops the right trials, worked by hand."""

from __future__ import annotations

import pytest

from trainer.selection.asha import Asha, AshaConfig


def test_asha_hand_worked_nine_trials() -> None:
    # 9 trials of 9 steps, reduction factor 3, min_steps 1 -> rungs at steps 1 and 3.
    asha = Asha(AshaConfig(reduction_factor=3, min_steps=1, mode="min"), max_steps=dict.fromkeys(range(9), 9))
    assert asha.rungs(0) == [1, 3]

    def rep(trial: int, step: int, value: float) -> tuple[list[int], list[int]]:
        d = asha.report(trial, step=step, value=value)
        return d.promoted, d.stopped

    # rung 1, in arrival order; promoted at once when in the top floor(n/3) of the n so far
    assert rep(0, 1, 5.0) == ([], [])  # n=1, top 0: pauses
    assert rep(1, 1, 4.0) == ([], [])  # n=2, top 0
    assert rep(2, 1, 3.0) == ([2], [])  # n=3, top 1 = {2}
    assert rep(3, 1, 6.0) == ([], [])  # n=4, top 1 = {2}, already promoted
    assert rep(4, 1, 1.0) == ([4], [])  # n=5, top 1 = {4}
    assert rep(5, 1, 7.0) == ([], [])  # n=6, top 2 = {4, 2}
    assert rep(6, 1, 2.0) == ([6], [])  # n=7, top 2 = {4, 6}: 6 goes on (2 keeps its promotion)
    assert rep(7, 1, 8.0) == ([], [])  # n=8, top 2
    # n=9, top 3 = {8, 4, 6}: 8 goes on; the rung is complete, so the paused rest stop
    assert rep(8, 1, 0.5) == ([8], [0, 1, 3, 5, 7])
    # rung 3 among 2, 4, 6, 8
    assert rep(4, 3, 0.9) == ([], [])  # n=1, top 0; 2, 6, 8 may still arrive
    assert asha.finished(2, step=2).stopped == []  # 2 failed before the rung: it will never arrive
    assert rep(6, 3, 0.7) == ([], [])  # n=2, top 0
    # n=3 and complete: top max(1, 1) = {6}
    assert rep(8, 3, 0.8) == ([6], [4, 8])
    assert asha.stopped == {0, 1, 3, 5, 7, 4, 8}


def test_asha_max_mode_and_the_best_trial_always_goes_on() -> None:
    asha = Asha(AshaConfig(reduction_factor=4, min_steps=2, mode="max"), max_steps={0: 10, 1: 10, 2: 2})
    assert asha.rungs(0) == [2, 8] and asha.rungs(2) == []
    assert asha.report(0, step=2, value=0.3).promoted == []
    # trial 2 ends at step 2 without a rung; the rung is still waiting on trial 1
    assert asha.finished(2, step=2).promoted == []
    d = asha.report(1, step=2, value=0.6)  # n=2 < 4, complete: top max(1, 0) = the best (higher)
    assert (d.promoted, d.stopped) == ([1], [0])


def test_a_trial_stopped_from_outside_completes_the_rung() -> None:
    asha = Asha(AshaConfig(reduction_factor=2, min_steps=1), max_steps=dict.fromkeys(range(3), 4))
    assert asha.report(0, step=1, value=2.0).promoted == []
    assert asha.report(1, step=1, value=1.0).promoted == [1]  # n=2, top 1
    d = asha.finished(2, step=0)
    assert (d.promoted, d.stopped) == ([], [0])


def test_a_resumed_trial_does_not_hold_up_the_rungs_it_passed() -> None:
    asha = Asha(AshaConfig(reduction_factor=2, min_steps=1), max_steps=dict.fromkeys(range(3), 8))
    asha.resumed(2, step=3)  # past rungs 1 and 2, next rung 4
    assert asha.report(0, step=1, value=2.0).promoted == []
    d = asha.report(1, step=1, value=1.0)  # rung 1 is complete without trial 2
    assert (d.promoted, d.stopped) == ([1], [0])
    assert asha.report(1, step=2, value=1.0).promoted == [1]  # alone at rung 2, complete
    assert asha.report(2, step=4, value=0.5).promoted == []  # trial 1 may still reach rung 4
    d = asha.report(1, step=4, value=0.7)
    assert (d.promoted, d.stopped) == ([2], [1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"reduction_factor": 1}, "reduction_factor must be >= 2, got 1"), ({"min_steps": 0}, "min_steps")],
)
def test_bad_asha_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AshaConfig(**kwargs)
