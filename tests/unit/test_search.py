"""Model-based search (core/search.py): a fixed seed gives the same suggestions, the replayed
study asks exactly what a live one asked, and TPE finds better than its random start on a space
whose answer is known."""

from __future__ import annotations

import math

import pytest

from core.search import SAMPLERS, Clock, check_fits, plan, space_size, suggest
from jobrules.space import SpaceError

SPACE = {
    "train.lr": {"low": 1e-5, "high": 1e-1, "log": True},
    "model.layers": {"low": 1, "high": 12},
    "train.optimizer": ["adamw", "sgd"],
}


def objective(p: dict) -> float:
    """Known answer: lr 10**-2.5, 4 layers, adamw (value 0 there)."""
    return (
        (math.log10(p["train.lr"]) + 2.5) ** 2
        + 0.1 * (p["model.layers"] - 4) ** 2
        + (0.0 if p["train.optimizer"] == "adamw" else 1.0)
    )


def run(method: str, *, seed: int, total: int, parallel: int, order_seed: int = 0) -> tuple[list, list]:
    """Drive a batch generation by generation, as the service does: each generation asked from a
    fresh replay, its trials 'finishing' in a shuffled order (which must not matter)."""
    import random

    values: list[float | None] = []
    params: list[dict] = []
    rng = random.Random(order_seed)
    while len(params) < total:
        new = suggest(
            space=SPACE,
            method=method,
            seed=seed,
            mode="min",
            parallel=parallel,
            values=values,
            total=total,
            startup_trials=8,
        )
        assert new[: len(params)] == params  # the replay asks what was asked before
        gen = new[len(params) :]
        done = {}
        for i in rng.sample(range(len(gen)), len(gen)):  # arrival order
            done[i] = objective(gen[i])
        values += [done[i] for i in range(len(gen))]
        params = new
    return params, values


def test_tpe_fixed_seed_suggests_the_same_trials_twice_whatever_the_finish_order() -> None:
    a, _ = run("tpe", seed=3, total=16, parallel=4, order_seed=0)
    b, _ = run("tpe", seed=3, total=16, parallel=4, order_seed=1)
    assert a == b
    c, _ = run("tpe", seed=4, total=16, parallel=4)
    assert c != a


def test_tpe_beats_its_random_start_on_a_known_space() -> None:
    params, values = run("tpe", seed=0, total=32, parallel=8)
    random_start = min(values[:8])  # TPE's first 8 are random (startup_trials)
    assert min(values) < random_start / 4
    best = params[values.index(min(values))]
    assert best["train.optimizer"] == "adamw" and abs(math.log10(best["train.lr"]) + 2.5) < 0.5


@pytest.mark.parametrize("method", ["cmaes", "qmc"])
def test_other_samplers_are_reproducible(method: str) -> None:
    a, _ = run(method, seed=1, total=12, parallel=3)
    assert a == run(method, seed=1, total=12, parallel=3, order_seed=5)[0]
    assert len({tuple(sorted(p.items())) for p in a}) == 12


def test_a_failed_trial_is_told_as_failed() -> None:
    ask = {"space": SPACE, "method": "tpe", "seed": 0, "mode": "min", "parallel": 2, "startup_trials": 1}
    first = suggest(values=[], total=4, **ask)
    more = suggest(values=[None, 1.0], total=4, **ask)
    assert more[:2] == first and len(more) == 4


@pytest.mark.parametrize(("method", "startup"), [("tpe", 4), ("cmaes", 3), ("tpe", None)])
def test_the_value_free_asks_are_asked_at_once_and_look_at_no_value(method: str, startup: int | None) -> None:
    """A sampler's random start-up trials are asked before anything is told (the API creates them
    all at submit, packed like a grid's), and they are the same points whatever the values: asking
    them one by one in index order only idled a device while an earlier trial ran."""
    free = startup if startup is not None else 10  # Optuna's TPESampler default
    ask = {"space": SPACE, "method": method, "seed": 5, "mode": "min", "parallel": 2}
    first = suggest(values=[], total=16, startup_trials=startup, **ask)
    assert len(first) == free
    for values in ([3.0, 1.0, None], [0.1] * free, [float(i) for i in range(free + 3)]):
        later = suggest(values=values, total=16, startup_trials=startup, **ask)
        assert later[:free] == first
        assert len(later) == min(16, max(free, len(values) + 2))
    assert len(suggest(values=[], total=6, startup_trials=startup, **ask)) == min(6, free)


def test_qmc_asks_every_trial_at_once() -> None:
    """qmc never looks at a value: the whole batch is its sequence, asked at submit."""
    ask = {"space": SPACE, "method": "qmc", "seed": 1, "mode": "min", "parallel": 2, "total": 12}
    first = suggest(values=[], **ask)
    assert len(first) == 12 and suggest(values=[5.0, 0.5, 2.0], **ask) == first


@pytest.mark.parametrize(
    ("method", "space", "message"),
    [
        ("cmaes", {"train.optimizer": ["adamw", "sgd"]}, "method cmaes searches numeric ranges"),
        ("tpe", {"train.lr": {"low": 0.1, "high": 1, "num": 3}}, "num \\(grid points\\) is for method grid"),
        ("tpe", {"train.nope": [1]}, "is not a JobSpec field"),
        ("anneal", SPACE, "method must be one of tpe, cmaes, qmc"),
    ],
)
def test_spaces_a_sampler_cannot_search_are_refused(method: str, space: dict, message: str) -> None:
    with pytest.raises(SpaceError, match=message):
        check_fits(method, space)


def test_the_database_knows_which_batches_grow_themselves() -> None:
    from db.selections import GROWING_METHODS

    assert set(SAMPLERS) == GROWING_METHODS


def run_async(*, seed: int, total: int, parallel: int, space: dict, value, arrival_seed: int) -> list:  # noqa: ANN001
    """Drive a batch as the service does now: `parallel` trials in flight, a new one asked as soon as
    one ends (in a shuffled arrival order), each ask a fresh replay from the ended prefix."""
    import random

    rng = random.Random(arrival_seed)
    params: list[dict] = []
    ended: dict[int, float] = {}
    running: list[int] = []
    while len(ended) < total:
        prefix = 0
        while prefix in ended:
            prefix += 1
        got = plan(
            space=space,
            method="tpe",
            seed=seed,
            mode="min",
            parallel=parallel,
            values=[ended[i] for i in range(prefix)],
            total=total,
            startup_trials=2,
        )
        assert [a.params for a in got.trials[: len(params)]] == params  # the replay asks what was asked
        if got.exhausted and len(got.trials) == len(params) and not running:
            break
        for a in got.trials[len(params) :]:
            running.append(len(params))
            params.append(a.params)
        done = running.pop(rng.randrange(len(running)))  # whichever ends first
        ended[done] = value(params[done])
    return params


def test_a_trial_is_asked_from_the_trials_parallel_before_it() -> None:
    """Trial k depends on the values of trials 0 .. k-parallel only: more values leave it as it is."""
    ask = {
        "space": SPACE,
        "method": "tpe",
        "seed": 2,
        "mode": "min",
        "parallel": 3,
        "total": 12,
        "startup_trials": 2,
    }
    full = suggest(values=[1.0] * 6, **ask)
    for m in range(6):
        some = suggest(values=[1.0] * m, **ask)
        assert len(some) == m + 3 and some == full[: m + 3]


def test_asking_as_trials_end_is_reproducible_whatever_the_arrival_order() -> None:
    a = run_async(seed=3, total=12, parallel=3, space=SPACE, value=objective, arrival_seed=0)
    b = run_async(seed=3, total=12, parallel=3, space=SPACE, value=objective, arrival_seed=7)
    assert a == b and len(a) == 12
    assert run_async(seed=4, total=12, parallel=3, space=SPACE, value=objective, arrival_seed=0) != a


SMALL = {"train.lr": [0.001, 0.01], "model.layers": [1, 2], "train.optimizer": ["adamw", "sgd"]}


def test_no_point_of_a_discrete_space_runs_twice() -> None:
    """8 points, 8 trials: every point once; the asks that repeated a point are named, not run."""
    assert space_size(SMALL) == 8 and space_size(SPACE) is None
    value = lambda p: p["train.lr"] * p["model.layers"]  # noqa: E731
    for seed in range(3):
        got = plan(
            space=SMALL, method="tpe", seed=seed, mode="min", parallel=2, values=[], total=8, startup_trials=2
        )
        params = run_async(seed=seed, total=8, parallel=2, space=SMALL, value=value, arrival_seed=seed)
        keys = {tuple(sorted(p.items())) for p in params}
        assert len(params) == 8 and len(keys) == 8
        assert params[:2] == [a.params for a in got.trials]
    values = [value(p) for p in params]
    full = plan(
        space=SMALL, method="tpe", seed=2, mode="min", parallel=2, values=values, total=8, startup_trials=2
    )
    assert any(a.repeats for a in full.trials)  # TPE did ask some point twice; that ask was skipped
    for k, a in enumerate(full.trials):
        assert all(j < k for j in a.repeats)


def test_a_spent_discrete_space_ends_the_search() -> None:
    value = lambda p: p["train.lr"]  # noqa: E731
    params = run_async(seed=0, total=12, parallel=2, space=SMALL, value=value, arrival_seed=0)
    assert len(params) == 8 and len({tuple(sorted(p.items())) for p in params}) == 8
    got = plan(
        space=SMALL, method="tpe", seed=0, mode="min", parallel=2, values=[value(p) for p in params], total=12
    )
    assert got.exhausted and len(got.trials) == 8


# -- the logical clock: trial k is told what ended first on paper, from the trials' costs ----------

STEPS = {"train.steps": [10, 40], "train.lr": {"low": 1e-4, "high": 1e-1, "log": True}}


def steps_cost(p: dict) -> float:
    return float(p["train.steps"])


def test_the_clock_runs_the_batch_on_paper_longest_first() -> None:
    one = Clock(devices=2, slots=1)
    one.start(0, 3.0)
    one.start(1, 1.0)
    assert one.ask() == [1, 0] and one.time == 3.0  # the shorter trial ends first
    # Sharded-LRTF: the longest runs alone until the others' work left meets it, then all share;
    # trials ending together end in index order
    three = Clock(devices=2, slots=1)
    for i, c in enumerate([2.0, 1.0, 1.0]):
        three.start(i, c)
    assert three.ask() == [0, 1, 2] and three.time == 2.0


def test_with_equal_costs_the_clock_is_the_index_order() -> None:
    """Every trial costing the same: trial k is told trials 0 .. k-parallel, whatever the devices."""
    ask = {"space": SPACE, "method": "tpe", "seed": 2, "mode": "min", "total": 12, "startup_trials": 2}
    for parallel, devices in [(2, 2), (3, 2), (2, 3)]:
        full = suggest(values=[1.0] * 6, parallel=parallel, devices=devices, cost=lambda p: 7.0, **ask)
        assert full == suggest(values=[1.0] * 6, parallel=parallel, **ask)
        for m in range(6):
            some = suggest(values=[1.0] * m, parallel=parallel, devices=devices, cost=lambda p: 7.0, **ask)
            assert some == full[: m + parallel]


def test_a_trial_is_asked_once_the_trials_that_end_first_on_paper_have_ended() -> None:
    """Seed 0's start-up trials: trial 0 trains 40 steps, trial 1 10. Trial 2 is asked once trial 1
    has ended, told trial 1 alone, while trial 0 still runs; trial 0 ending first changes nothing
    (trial 2 still waits for trial 1: the order is the clock's, never the wall's)."""
    ask = {"space": STEPS, "method": "tpe", "seed": 0, "mode": "min", "parallel": 2, "total": 6}
    ask.update(startup_trials=2, cost=steps_cost)
    first = suggest(values={}, **ask)
    assert [p["train.steps"] for p in first] == [40, 10]
    assert suggest(values={0: 1.0}, **ask) == first  # trial 0 ended first for real: trial 2 waits
    got = suggest(values={1: 2.0}, **ask)
    assert len(got) == 3 and got[:2] == first
    assert suggest(values={0: 1.0, 1: 2.0}, **ask)[:3] == got  # trial 0's value was not told to it
    # the index order (no costs) would have trial 2 wait for trial 0, a device idle meanwhile
    assert len(suggest(values={1: 2.0}, **{**ask, "cost": None})) == 2


def run_clocked(*, seed: int, total: int, arrival_seed: int, tail: int) -> list:
    """A batch driven as the service drives it: trials in flight end in a shuffled order, each ask
    a fresh replay from the trials that ended (a mapping, not a prefix)."""
    import random

    rng = random.Random(arrival_seed)
    ask = {"space": STEPS, "method": "tpe", "seed": seed, "mode": "min", "parallel": 2, "total": total}
    ask.update(startup_trials=2, cost=steps_cost, tail=tail)
    params: list[dict] = []
    ended: dict[int, float] = {}
    running: list[int] = []
    while len(ended) < total:
        got = suggest(values=ended, **ask)
        assert got[: len(params)] == params  # the replay asks what was asked
        for p in got[len(params) :]:
            running.append(len(params))
            params.append(p)
        done = running.pop(rng.randrange(len(running)))
        ended[done] = objective({**params[done], "model.layers": 4, "train.optimizer": "adamw"})
    return params


@pytest.mark.parametrize("tail", [0, 1])
def test_the_clock_gives_the_same_suggestions_whatever_the_arrival_order(tail: int) -> None:
    a = run_clocked(seed=3, total=10, arrival_seed=0, tail=tail)
    assert a == run_clocked(seed=3, total=10, arrival_seed=9, tail=tail) and len(a) == 10
    assert run_clocked(seed=4, total=10, arrival_seed=0, tail=tail) != a


def test_the_last_trial_is_asked_with_the_one_before_it() -> None:
    """TAIL: the batch's last trial is due with the one before it, told the same trials (the
    executor then shares the devices among the three trials left instead of one running alone)."""
    ask = {"space": SPACE, "method": "tpe", "seed": 1, "mode": "min", "parallel": 2, "total": 6}
    ask.update(startup_trials=2, cost=lambda p: 1.0)
    assert len(suggest(values=[1.0, 2.0, 3.0], tail=0, **ask)) == 5
    with_tail = suggest(values=[1.0, 2.0, 3.0], tail=1, **ask)
    assert len(with_tail) == 6
    assert with_tail[:5] == suggest(values=[1.0, 2.0, 3.0], tail=0, **ask)
    # only the last trial: the upto-limited replay of a worker's single ask agrees
    assert suggest(values=[1.0, 2.0, 3.0], tail=1, upto=5, **ask) == with_tail[:5]
