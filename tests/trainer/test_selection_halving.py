"""ASHA, successive halving and Hyperband decide from the metrics and the seed alone, checked
against examples worked by hand and against every order in which the reports could arrive."""

from __future__ import annotations

import random

import pytest

from trainer.selection.halving import Halving, HalvingConfig, StopReason, hyperband_sizes


def nine(kind: str, **kw: object) -> Halving:
    # 9 trials of 9 steps, reduction factor 3, min_steps 1 -> rungs at steps 1 and 3
    cfg = HalvingConfig(kind=kind, reduction_factor=3, min_steps=1, mode="min", seed=7, **kw)
    return Halving(cfg, max_steps=dict.fromkeys(range(9), 9))


# each trial's value at rung 1, by its position in the logical order
RUNG1 = [5.0, 4.0, 3.0, 6.0, 1.0, 7.0, 2.0, 8.0, 0.5]


def test_asha_hand_worked_in_logical_order() -> None:
    h = nine("asha")
    p = h.order  # p[k]: the trial k-th in logical order (a seeded shuffle, not index order)
    assert sorted(p) == list(range(9)) and p != list(range(9))
    assert h.rungs(0) == [1, 3]

    def rep(k: int, step: int, value: float) -> tuple[list[int], list[int]]:
        d = h.report(p[k], step=step, value=value)
        return d.promoted, d.stopped

    # rung 1: each report taken in order; every waiting trial in the top floor(n/3) goes on
    assert rep(0, 1, 5.0) == ([], [])  # n=1, top 0
    assert rep(1, 1, 4.0) == ([], [])  # n=2, top 0
    assert rep(2, 1, 3.0) == ([p[2]], [])  # n=3, top 1 = {p2}
    assert rep(3, 1, 6.0) == ([], [])  # n=4, top 1 = {p2}, already on
    assert rep(4, 1, 1.0) == ([p[4]], [])  # n=5, top 1 = {p4}
    assert rep(5, 1, 7.0) == ([], [])  # n=6, top 2 = {p4, p2}
    assert rep(6, 1, 2.0) == ([p[6]], [])  # n=7, top 2 = {p4, p6}; p2 keeps its promotion
    assert rep(7, 1, 8.0) == ([], [])  # n=8
    # n=9: top 3 = {p8, p4, p6}; the rung is complete, the waiting rest stop below the cut-off 2.0
    assert rep(8, 1, 0.5) == ([p[8]], [p[1], p[0], p[3], p[5], p[7]])
    assert h.stopped[p[0]] == StopReason(rung=1, value=5.0, cutoff=2.0, kept=3, of=9, bracket=2)
    # rung 3: p4 arrives first but waits for p2, which comes before it in logical order
    assert rep(4, 3, 0.9) == ([], [])
    assert h.paused() == {p[4]}
    # the trials that can still reach rung 3 are the ones to run first
    assert h.blocking() == {p[2], p[6], p[8]}
    assert h.finished(p[2], step=2).stopped == []  # p2 failed before the rung; p4 is taken (n=1)
    assert rep(6, 3, 0.7) == ([], [])  # n=2
    assert rep(8, 3, 0.8) == ([p[6]], [p[8], p[4]])  # n=3: top 1 = {p6}; stops in rank order
    assert h.stopped[p[8]] == StopReason(rung=3, value=0.8, cutoff=0.7, kept=1, of=3, bracket=2)


def drive(h: Halving, *, arrival_seed: int) -> tuple[dict, dict]:
    """Run a batch's rung reports in a random interleaving: any running trial may be the next to
    reach its next rung (or its end); paused trials run again only when promoted."""
    rng = random.Random(arrival_seed)
    rung1 = dict(zip(h.order, RUNG1, strict=True))
    value = {t: {1: rung1[t], 3: 10.0 - rung1[t] / 2} for t in rung1}  # the second rung reverses
    reached = dict.fromkeys(rung1, 0)
    running = set(rung1)
    while running:
        t = rng.choice(sorted(running))
        running.discard(t)
        if reached[t] < len(h.rungs(t)):
            r = h.rungs(t)[reached[t]]
            reached[t] += 1
            d = h.report(t, step=r, value=value[t][r])
        else:
            d = h.finished(t, step=9)
        running.update(d.promoted)
    assert not h.paused()
    return dict(h.stopped), {key: sorted(v) for key, v in h.promoted.items()}


@pytest.mark.parametrize("kind", ["asha", "sha", "hyperband"])
def test_any_arrival_order_gives_the_same_decisions(kind: str) -> None:
    """Reports arrive in whatever order the threads reach the rungs; decisions must not care."""
    outcomes = [drive(nine(kind), arrival_seed=s) for s in range(20)]
    assert all(o == outcomes[0] for o in outcomes)
    stopped, promoted = outcomes[0]
    assert stopped and promoted  # something was decided
    # a different seed orders the trials differently: the decisions are the seed's too
    assert (
        nine(kind).order
        != Halving(
            HalvingConfig(kind=kind, reduction_factor=3, min_steps=1, seed=8),
            max_steps=dict.fromkeys(range(9), 9),
        ).order
    )


def test_sha_hand_worked_waits_for_the_whole_rung() -> None:
    h = nine("sha")
    p = h.order
    for k in range(8):  # in reverse logical order too: nothing is decided before the rung is full
        d = h.report(p[8 - k], step=1, value=RUNG1[8 - k])
        assert (d.promoted, d.stopped) == ([], [])
    d = h.report(p[0], step=1, value=RUNG1[0])
    # top max(1, 9 // 3) = 3: p8 (0.5), p4 (1.0), p6 (2.0); p2 (3.0) stops, unlike in ASHA
    assert sorted(d.promoted) == sorted([p[8], p[4], p[6]])
    assert sorted(d.stopped) == sorted(set(p) - {p[8], p[4], p[6]})
    assert h.stopped[p[2]] == StopReason(rung=1, value=3.0, cutoff=2.0, kept=3, of=9, bracket=2)
    h.report(p[6], step=3, value=0.3)
    h.report(p[8], step=3, value=0.2)
    d = h.report(p[4], step=3, value=0.1)
    assert (d.promoted, d.stopped) == ([p[4]], [p[8], p[6]])


def test_hyperband_sizes_hand_worked() -> None:
    # rf 3, s_max 2: n_s = ceil(3 * 3**s / (s + 1)) = 9, 5, 3 for s = 2, 1, 0
    assert hyperband_sizes(17, s_max=2, reduction_factor=3) == [9, 5, 3]
    # 8 trials: 8 * (9, 5, 3) / 17 = 4.24, 2.35, 1.41 -> 4, 2, 1 and the largest remainder (s=0) +1
    assert hyperband_sizes(8, s_max=2, reduction_factor=3) == [4, 2, 2]
    # rf 2, s_max 3: ceil(4 * 2**s / (s + 1)) = 8, 6, 4, 4
    assert hyperband_sizes(22, s_max=3, reduction_factor=2) == [8, 6, 4, 4]


def test_hyperband_brackets_hand_worked() -> None:
    cfg = HalvingConfig(kind="hyperband", reduction_factor=3, min_steps=1, seed=3)
    h = Halving(cfg, max_steps=dict.fromkeys(range(17), 9))
    p = h.order
    b2, b1, b0 = p[:9], p[9:14], p[14:]  # brackets fill in logical order: 9, 5, 3 trials
    assert {h.bracket[t] for t in b2} == {2} and {h.bracket[t] for t in b1} == {1}
    assert {h.bracket[t] for t in b0} == {0}
    assert h.rungs(b2[0]) == [1, 3] and h.rungs(b1[0]) == [3] and h.rungs(b0[0]) == []
    # bracket 1 starts at rung 3 with 5 trials and keeps max(1, 5 // 3) = 1
    for k, t in enumerate(b1[:4]):
        assert h.report(t, step=3, value=float(k + 1)).stopped == []
    # bracket 2's reports at rung 1 do not complete bracket 1's rung 3
    for t, v in zip(b2[:8], RUNG1, strict=False):
        h.report(t, step=1, value=v)
    d = h.report(b1[4], step=3, value=0.5)
    assert d.promoted == [b1[4]] and sorted(d.stopped) == sorted(b1[:4])
    assert h.stopped[b1[0]] == StopReason(rung=3, value=1.0, cutoff=0.5, kept=1, of=5, bracket=1)
    d = h.report(b2[8], step=1, value=RUNG1[8])
    assert sorted(d.promoted) == sorted([b2[8], b2[4], b2[6]])


def test_max_mode_and_the_best_trial_always_goes_on() -> None:
    cfg = HalvingConfig(reduction_factor=4, min_steps=2, mode="max", seed=0)
    h = Halving(cfg, max_steps={0: 10, 1: 10, 2: 2})
    assert h.rungs(0) == [2, 8] and h.rungs(2) == []
    first, second = [t for t in h.order if t != 2]
    assert h.report(first, step=2, value=0.3).promoted == []
    assert h.finished(2, step=2).promoted == []  # no rung for trial 2; rung 2 still waits
    d = h.report(second, step=2, value=0.6)  # n=2 < 4, complete: top max(1, 0) = the higher one
    assert (d.promoted, d.stopped) == ([second], [first])


def test_a_trial_stopped_from_outside_completes_the_rung() -> None:
    h = Halving(HalvingConfig(reduction_factor=2, min_steps=1), max_steps=dict.fromkeys(range(3), 4))
    a, b = [t for t in h.order if t != 2]
    for t, v in ((a, 2.0), (b, 1.0)):
        h.report(t, step=1, value=v)
    d = h.finished(2, step=0)
    assert b not in h.stopped and a in h.stopped and (d.stopped == [a] or h.stopped[a].rung == 1)


def test_a_resumed_trial_does_not_hold_up_the_rungs_it_passed() -> None:
    h = Halving(
        HalvingConfig(kind="sha", reduction_factor=2, min_steps=1), max_steps=dict.fromkeys(range(3), 8)
    )
    h.resumed(2, step=3)  # past rungs 1 and 2, next rung 4
    a, b = [t for t in h.order if t != 2]
    h.report(a, step=1, value=2.0)
    d = h.report(b, step=1, value=1.0)  # rung 1 is complete without trial 2
    assert (d.promoted, d.stopped) == ([b], [a])
    assert h.report(b, step=2, value=1.0).promoted == [b]  # alone at rung 2, complete
    assert h.report(2, step=4, value=0.5).promoted == []  # trial b may still reach rung 4
    d = h.report(b, step=4, value=0.7)
    assert (d.promoted, d.stopped) == ([2], [b])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reduction_factor": 1}, "reduction_factor must be >= 2, got 1"),
        ({"min_steps": 0}, "min_steps"),
        ({"kind": "median"}, "kind must be one of asha, sha, hyperband"),
    ],
)
def test_bad_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HalvingConfig(**kwargs)
