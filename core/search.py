"""Model-based search for selection batches: Optuna's samplers through its ask-and-tell interface.

A batch with `method` tpe, cmaes or qmc keeps `parallel` trials in flight and asks a new one as soon
as one ends, never waiting for a generation. The order is logical, never the wall's: which trials
trial k is told comes from a `Clock` that runs the batch on paper, with each trial's work estimated
from its spec (jobrules/sizing.py `trial_flops`, the executor's own estimate before it measures) and
scheduled as the executor schedules it (longest work left first over the devices). Trial k is asked
at the first moment on paper that fewer than `parallel` trials are in flight, told exactly the
trials that have ended there (in the order they ended there), with the others still running (TPE's
constant liar treats those as pessimistically done, so it looks elsewhere). The real run asks trial
k once those trials have really ended: where the estimate was right that is when a device frees, and
where it was wrong the device waits, for the trial the clock said would end first. Nothing depends on
which trial really finished first, so a fixed seed gives the same suggestions whenever the trials
report the same values. With equal costs the clock is the index order (trial k told trials
0 .. k-parallel), which is what every sampler batch did before: there a short trial that ended
before a longer, earlier one could not hand its device on until the earlier one had ended too.

The batch's last trial is asked with the one before it (`TAIL`): the last trial asked when a device
frees runs alone while the other devices run out of work; asked one trial earlier, the executor
shares the three trials left over two devices. It is told one trial less than it would have been.

Except for the asks that look at no value (`free_asks`): the random start-up trials of tpe and
cmaes, and every trial of qmc (a low-discrepancy sequence). Those are asked at once, before any
value is told, so the API creates them all at submit and the executor packs them longest first
(Sharded-LRTF), as it packs a grid, instead of one by one in index order. Waiting for the prefix
there only idled a device: on the 8-point grid of bench.peer --search with 4 start-up trials, TPE's
wall was 1.09x the grid's (median of 5 seeds, a quiet 2-core machine) with the start-up trials
asked one by one.

A sampler may ask a point an earlier trial already has (likely on a small discrete space). That ask
is not run: it is told the earlier trial's value once that trial is told (at once when it already
is), and the sampler is asked again, up to MAX_REPEATS times; the trial finally asked lists the
trials it repeated first (`Asked.repeats`). When every point of a finite space has a trial, the
search ends there (`Plan.exhausted`), fewer trials than asked for.

The study is not kept anywhere: `plan` replays the whole ask-and-tell sequence (and the clock) from
the seed, the trials' parameters and the values so far, and returns every trial's parameters up to
the last one that may be asked now (`request_plan`: the same for the API and every worker).
The replay reproduces the parameters already stored for the earlier trials (the caller checks), which
is what makes any worker, or the API at submit, able to ask the next trial. Replaying is cheap next
to training (milliseconds per trial).

The space is the batch's own (jobrules/space.py): a choice becomes a categorical distribution, a
range a float or int distribution (log-scaled with `log`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from jobrules.sizing import trial_flops
from jobrules.space import Choice, Range, SpaceError, apply_params, parse_space
from jobrules.spec import (
    SAMPLERS,  # `method` values a sampler serves (grid and random: jobrules/space.py)
    SelectionCreate,
    stored,
)

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.samplers import BaseSampler


@functools.cache
def _optuna() -> ModuleType:
    # imported on first use: optuna takes about a second to import, and only sampler batches
    # need it (the API and every worker import this module)
    import optuna

    optuna.logging.set_verbosity(logging.WARNING)
    return optuna


def distributions(space: dict[str, Any]) -> dict[str, BaseDistribution]:
    dist = _optuna().distributions
    out: dict[str, BaseDistribution] = {}
    for d in parse_space(space):
        if isinstance(d, Choice):
            out[d.path] = dist.CategoricalDistribution(d.values)
        elif isinstance(d, Range):
            if d.num is not None:
                raise SpaceError(
                    f"space[{d.path!r}]: num (grid points) is for method grid; a sampler draws from "
                    f"the whole range [{d.low}, {d.high}]"
                )
            if d.integer:
                out[d.path] = dist.IntDistribution(int(d.low), int(d.high), log=d.log)
            else:
                out[d.path] = dist.FloatDistribution(float(d.low), float(d.high), log=d.log)
    return out


def check_fits(method: str, space: dict[str, Any]) -> None:
    """Refuse a sampler that cannot search this space, naming the reason."""
    if method not in SAMPLERS:
        raise SpaceError(f"method must be one of {', '.join(SAMPLERS)} for a sampler, got {method!r}")
    dists = distributions(space)
    categorical = _optuna().distributions.CategoricalDistribution
    if method in ("cmaes", "qmc") and all(isinstance(d, categorical) for d in dists.values()):
        raise SpaceError(
            f"method {method} searches numeric ranges; this space has only choices "
            f"({', '.join(dists)}): use tpe, random or grid"
        )


def free_asks(method: str, startup_trials: int | None) -> int:
    """How many first trials the sampler asks without looking at any told value: tpe's and cmaes's
    random start-up trials (`startup_trials`, else the sampler's own default), and every one of
    qmc's. Asked before any value is told, they are the same points whenever they are asked."""
    if method == "qmc":
        return sys.maxsize
    if startup_trials is not None:
        return startup_trials
    optuna = _optuna()
    cls = {"tpe": optuna.samplers.TPESampler, "cmaes": optuna.samplers.CmaEsSampler}[method]
    return int(inspect.signature(cls).parameters["n_startup_trials"].default)


def make_sampler(method: str, *, seed: int, startup_trials: int | None) -> BaseSampler:
    optuna = _optuna()
    startup = {} if startup_trials is None else {"n_startup_trials": startup_trials}
    if method == "tpe":
        # constant_liar: a trial is asked while the `parallel - 1` before it still run, so each ask
        # treats those as (pessimistically) done and looks elsewhere
        sampler: BaseSampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True, **startup)
        return sampler
    if method == "cmaes":
        sampler = optuna.samplers.CmaEsSampler(seed=seed, **startup, warn_independent_sampling=False)
        return sampler
    if method == "qmc":
        with warnings.catch_warnings():  # "experimental": the interface, not the sampling
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.QMCSampler(seed=seed, scramble=True, warn_independent_sampling=False)
        return sampler
    raise SpaceError(f"method must be one of {', '.join(SAMPLERS)} for a sampler, got {method!r}")


class Clock:
    """The logical clock that says which trials a sampler has been told when it asks trial k: the
    batch run on paper, with each trial's estimated cost (`plan`'s `cost`), by the executor's own
    rule (trainer/selection/policy.py, Sharded-LRTF: the trials with the most work left take the
    devices, so trials of equal work left share them, as fluid processor sharing here). The
    value-free trials start at time 0; every later trial is asked at the first moment fewer than
    `slots` trials are in flight, and is told exactly the trials that ended by then. Trials that end
    at the same moment end in index order, one at a time (the executor breaks ties to the lower
    index), so with equal costs trial k is told trials 0 .. k-slots: the index order.

    Nothing here reads a clock: the same costs give the same schedule, so the same told sets and
    the same suggestions on any machine. The real run asks trial k once the trials it is told have
    ended; where the estimate was right, they have when a device frees."""

    def __init__(self, *, devices: int, slots: int) -> None:
        if devices < 1 or slots < 1:
            raise ValueError(f"devices and slots must be >= 1, got {devices} and {slots}")
        self.devices, self.slots = devices, slots
        self.time = 0.0
        self.left: dict[int, float] = {}
        """Work left of each trial in flight, in device-seconds of the cost's unit."""
        self.ended: list[int] = []
        """Trials in the order they ended on paper."""
        self._scale = 0.0

    def start(self, k: int, cost: float) -> None:
        cost = max(float(cost), 0.0)
        self._scale = max(self._scale, cost)
        self.left[k] = cost

    def ask(self, extra: int = 0) -> list[int]:
        """Run the schedule until a trial may be asked (fewer than `slots` + `extra` in flight);
        the trials ended by then, in the order they ended."""
        while len(self.left) >= self.slots + extra:
            self._step()
        return self.ended

    def _close(self, a: float, b: float) -> bool:
        return abs(a - b) <= 1e-9 * self._scale

    def _step(self) -> None:
        """Advance to the next moment a trial ends (one trial: ties end in index order) or two
        levels of work left meet."""
        done = sorted(i for i, x in self.left.items() if self._close(x, 0.0))
        if done:
            self.ended.append(done[0])
            del self.left[done[0]]
            return
        # levels of equal work left, most first; each level shares the devices the levels above
        # it left over, at most one device a trial
        order = sorted(self.left, key=lambda i: (-self.left[i], i))
        levels: list[list[int]] = []
        for i in order:
            if levels and self._close(self.left[levels[-1][0]], self.left[i]):
                levels[-1].append(i)
            else:
                levels.append([i])
        free, rates, tops = float(self.devices), [], []
        for lv in levels:
            rates.append(min(1.0, free / len(lv)) if free > 0 else 0.0)
            tops.append(self.left[lv[0]])
            free = max(0.0, free - len(lv))
        dt = min(top / r for top, r in zip(tops, rates, strict=True) if r > 0)
        for a in range(len(levels) - 1):
            if rates[a] > rates[a + 1]:
                dt = min(dt, (tops[a] - tops[a + 1]) / (rates[a] - rates[a + 1]))
        self.time += dt
        for lv, top, r in zip(levels, tops, rates, strict=True):
            for i in lv:  # one value a level: levels that meet stay one
                self.left[i] = max(0.0, top - r * dt)


MAX_REPEATS = 64
"""Asks in a row that may repeat earlier trials' points before the search gives up on a new one."""


@dataclass(frozen=True, slots=True)
class Asked:
    params: dict[str, Any]
    repeats: tuple[int, ...] = ()
    """Earlier trials whose points the sampler asked first for this trial, skipped (not run)."""


@dataclass(slots=True)
class Plan:
    trials: list[Asked] = field(default_factory=list)
    exhausted: bool = False
    """Every point of a finite space has a trial (or MAX_REPEATS asks in a row repeated one): the
    search asks nothing more."""


def space_size(space: dict[str, Any]) -> int | None:
    """How many distinct points the space has; None when a float range makes it continuous."""
    dist = _optuna().distributions
    n = 1
    for d in distributions(space).values():
        if isinstance(d, dist.CategoricalDistribution):
            n *= len(d.choices)
        elif isinstance(d, dist.IntDistribution) and not d.log:
            n *= (d.high - d.low) // d.step + 1
        elif isinstance(d, dist.IntDistribution):
            n *= d.high - d.low + 1
        else:
            return None
    return n


def plan(
    *,
    space: dict[str, Any],
    method: str,
    seed: int,
    mode: str,
    parallel: int,
    values: Sequence[float | None] | Mapping[int, float | None],
    total: int,
    startup_trials: int | None = None,
    devices: int | None = None,
    cost: Callable[[dict[str, Any]], float | None] | None = None,
    tail: int = 0,
    upto: int | None = None,
) -> Plan:
    """The trials that may be asked once the trials in `values` have ended (at most `upto`).

    Trial k is asked once the trials its ask is told have ended: those the `Clock` has ended when it
    asks k, running the batch on paper on `devices` (default `parallel`) with `cost(params)` each
    trial's estimated work (no cost, or None: 1 a trial, which gives the index order: trial k is
    told trials 0 .. k-parallel). The value-free start-up asks come first, told nothing. The last
    `tail` trials are asked with one trial more in flight, so the executor can pack the batch's end
    (the last trial asked when a device frees runs alone while the other devices have no trial).
    `values` maps an ended trial's index to its metric (None: it failed or has none); a sequence is
    trials 0 .. len - 1. A trial that ended before the clock says waits to be told: the order of
    asks and tells never depends on which trial really ended first."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    ended = dict(values) if isinstance(values, Mapping) else dict(enumerate(values))
    optuna = _optuna()
    dists = distributions(space)
    size = space_size(space)
    study = optuna.create_study(
        direction="minimize" if mode == "min" else "maximize",
        sampler=make_sampler(method, seed=seed, startup_trials=startup_trials),
    )

    def tell(t: Any, v: float | None) -> None:
        if v is None:
            study.tell(t, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(t, float(v))

    out = Plan()
    asked: list[Any] = []
    shadows: dict[int, list[Any]] = {}  # skipped repeats of trial j, told when j is
    seen: dict[tuple[tuple[str, str], ...], int] = {}
    told: set[int] = set()
    free = free_asks(method, startup_trials)
    clock = Clock(devices=devices or parallel, slots=parallel)
    while len(out.trials) < min(total, total if upto is None else upto):
        k = len(out.trials)
        if k >= free:  # a free ask is told nothing
            due = clock.ask(1 if k >= total - tail else 0)
            if any(j not in ended for j in due):
                break  # trial k waits for a trial the clock has ended: the order is logical
            for j in due:  # in the order they ended on paper, never in the order they really did
                if j not in told:
                    for t in [asked[j], *shadows.pop(j, [])]:
                        tell(t, ended[j])
                    told.add(j)
        if size is not None and len(seen) >= size:
            out.exhausted = True
            break
        repeats: list[int] = []
        for _ in range(MAX_REPEATS + 1):
            t = study.ask(dists)
            params = {path: _plain(v) for path, v in t.params.items()}
            key = tuple(sorted((p, repr(v)) for p, v in params.items()))
            same = seen.get(key)
            if same is None:
                break
            repeats.append(same)
            if same in told:
                tell(t, ended[same])  # the same point's value, known already
            else:
                shadows.setdefault(same, []).append(t)  # still running: told with it
        else:
            out.exhausted = True
            break
        seen[key] = k
        asked.append(t)
        out.trials.append(Asked(params=params, repeats=tuple(repeats)))
        work = cost(params) if cost is not None else None
        clock.start(k, 1.0 if work is None else work)
    return out


TAIL = 1
"""A batch's last trial is asked together with the one before it (`plan`'s `tail`): on paper, the
executor then packs the three trials left over two devices where the last one would run alone. One
more trial was worse (everything left ends together and the last ask runs alone again)."""


def trial_cost(base: dict[str, Any]) -> Callable[[dict[str, Any]], float | None]:
    """A trial's estimated work from its parameters over the stored request's `base` (a full
    JobSpec dump): jobrules/sizing.py `trial_flops`, the executor's own estimate before it measures.
    A pure function of the request: the API and every worker replay the same clock."""

    def cost(params: dict[str, Any]) -> float | None:
        try:
            return trial_flops(apply_params(base, params))
        except (KeyError, TypeError, ValueError, SpaceError):
            return None  # a partial base (tests) or an unsized field: 1, the index order

    return cost


def request_plan(
    req: dict[str, Any],
    *,
    values: Sequence[float | None] | Mapping[int, float | None],
    upto: int | None = None,
) -> Plan:
    """`plan` for a stored selection request (SelectionCreate's dump): its space, method, seed,
    mode, parallel (default: devices), devices, start-up trials and trials, each trial's cost from
    its spec, the tail rule. The API asks the first trials with it, the workers the next ones."""
    read = stored(SelectionCreate, req)
    return plan(
        space=read.space,
        method=read.method,
        seed=read.seed,
        mode=read.mode,
        parallel=read.generation,
        devices=read.devices,
        values=values,
        total=read.trials or 0,
        startup_trials=read.startup_trials,
        cost=trial_cost(read.base.model_dump()),
        tail=TAIL,
        upto=upto,
    )


def suggest(**plan_args: Any) -> list[dict[str, Any]]:
    """The parameters of `plan(**plan_args)`'s trials."""
    return [a.params for a in plan(**plan_args).trials]


def _plain(v: Any) -> Any:
    # Optuna hands back numpy scalars from some samplers; JSON and JobSpec want Python values
    return v.item() if hasattr(v, "item") else v
