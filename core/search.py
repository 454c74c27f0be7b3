"""Model-based search for selection batches: Optuna's samplers through its ask-and-tell interface.

A batch with `method` tpe, cmaes or qmc keeps `parallel` trials in flight and asks a new one as soon
as one ends, never waiting for a generation. The order is logical, not the clock's: trial k is asked
once trials 0 .. k-parallel have ended, after the sampler has been told their values in index order,
with trials k-parallel+1 .. k-1 still running (TPE's constant liar treats them as pessimistically
done, so it looks elsewhere). Nothing depends on which trial finished first, so a fixed seed gives
the same suggestions whenever the trials report the same values. A trial that ends before an earlier
one cannot hand its device to a new trial until the earlier one has ended too.

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

The study is not kept anywhere: `plan` replays the whole ask-and-tell sequence from the seed and
the values so far, and returns every trial's parameters up to the last one that may be asked now.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from jobrules.space import Choice, Range, SpaceError, parse_space
from jobrules.spec import SAMPLERS  # `method` values a sampler serves (grid and random: jobrules/space.py)

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


def askable(*, told: int, parallel: int, free: int, total: int) -> int:
    """How many trials may have been asked once trials 0 .. told-1 have ended: the `free` ones at
    any time, and trial k >= free once trial k-parallel has ended."""
    return min(total, max(free, told + parallel))


def make_sampler(method: str, *, seed: int, startup_trials: int | None) -> BaseSampler:
    optuna = _optuna()
    startup = {} if startup_trials is None else {"n_startup_trials": startup_trials}
    if method == "tpe":
        # constant_liar: a trial is asked while the `parallel - 1` before it still run, so each ask
        # treats those as (pessimistically) done and looks elsewhere
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True, **startup)
    if method == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, **startup, warn_independent_sampling=False)
    if method == "qmc":
        with warnings.catch_warnings():  # "experimental": the interface, not the sampling
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.QMCSampler(seed=seed, scramble=True, warn_independent_sampling=False)
    raise SpaceError(f"method must be one of {', '.join(SAMPLERS)} for a sampler, got {method!r}")


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
    values: Sequence[float | None],
    total: int,
    startup_trials: int | None = None,
) -> Plan:
    """Trials 0 .. askable(...) - 1: those that may be asked once trials 0 .. len(values) - 1 have
    ended (the value-free start-up asks at any time, before anything is told). `values[i]` is
    trial i's metric (None: it failed or has none); the values are a prefix: a trial that ended
    after a running one waits for it to be told."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
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
    seen: dict[tuple, int] = {}
    told = 0
    free = free_asks(method, startup_trials)
    end = askable(told=len(values), parallel=parallel, free=free, total=total)
    while len(out.trials) < end:
        k = len(out.trials)
        # told in index order, never in the order the trials ended; a free ask is told nothing
        while k >= free and told <= k - parallel:
            for t in [asked[told], *shadows.pop(told, [])]:
                tell(t, values[told])
            told += 1
        if size is not None and len(seen) >= size:
            out.exhausted = True
            break
        repeats: list[int] = []
        for _ in range(MAX_REPEATS + 1):
            t = study.ask(dists)
            params = {path: _plain(v) for path, v in t.params.items()}
            key = tuple(sorted((p, repr(v)) for p, v in params.items()))
            j = seen.get(key)
            if j is None:
                break
            repeats.append(j)
            if j < told:
                tell(t, values[j])  # the same point's value, known already
            else:
                shadows.setdefault(j, []).append(t)  # still running: told with it
        else:
            out.exhausted = True
            break
        seen[key] = k
        asked.append(t)
        out.trials.append(Asked(params=params, repeats=tuple(repeats)))
    return out


def suggest(**plan_args: Any) -> list[dict[str, Any]]:
    """The parameters of `plan(**plan_args)`'s trials."""
    return [a.params for a in plan(**plan_args).trials]


def _plain(v: Any) -> Any:
    # Optuna hands back numpy scalars from some samplers; JSON and JobSpec want Python values
    return v.item() if hasattr(v, "item") else v
