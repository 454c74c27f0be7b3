"""Model-based search for selection batches: Optuna's samplers through its ask-and-tell interface.

A batch with `method` tpe, cmaes or qmc grows in generations of `parallel` trials. Generation g
(trials g*P .. g*P+P-1) is asked once every trial before it has ended, and the sampler has been told
their values in trial-index order. Nothing depends on which trial finished first, so a fixed seed
gives the same suggestions whenever the trials report the same values.

The study is not kept anywhere: `suggest` replays the whole ask-and-tell sequence from the seed and
the values so far, and returns every trial's parameters up to the end of the next generation. The
replay reproduces the parameters already stored for the earlier trials (the caller checks), which
is what makes any worker, or the API at submit, able to ask the next generation. Replaying is
cheap next to training (milliseconds per trial).

The space is the batch's own (jobrules/space.py): a choice becomes a categorical distribution, a
range a float or int distribution (log-scaled with `log`).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Sequence
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


def make_sampler(method: str, *, seed: int, startup_trials: int | None) -> BaseSampler:
    optuna = _optuna()
    startup = {} if startup_trials is None else {"n_startup_trials": startup_trials}
    if method == "tpe":
        # constant_liar: the trials of one generation are asked before any of them is told, so
        # each later ask treats the earlier ones as (pessimistically) done and looks elsewhere
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True, **startup)
    if method == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, **startup, warn_independent_sampling=False)
    if method == "qmc":
        with warnings.catch_warnings():  # "experimental": the interface, not the sampling
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.QMCSampler(seed=seed, scramble=True, warn_independent_sampling=False)
    raise SpaceError(f"method must be one of {', '.join(SAMPLERS)} for a sampler, got {method!r}")


def suggest(
    *,
    space: dict[str, Any],
    method: str,
    seed: int,
    mode: str,
    parallel: int,
    values: Sequence[float | None],
    total: int,
    startup_trials: int | None = None,
) -> list[dict[str, Any]]:
    """Parameters of trials 0 .. min(total, len(values) + parallel) - 1: the replayed earlier
    generations and the next one. `values[i]` is trial i's metric (None: it failed or has none);
    `len(values)` must end a generation (a multiple of `parallel`, or every trial there is)."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    n = len(values)
    if n % parallel and n != total:
        raise ValueError(f"{n} values do not end a generation of {parallel} trials")
    optuna = _optuna()
    dists = distributions(space)
    study = optuna.create_study(
        direction="minimize" if mode == "min" else "maximize",
        sampler=make_sampler(method, seed=seed, startup_trials=startup_trials),
    )
    out: list[dict[str, Any]] = []
    end = min(total, n + parallel)
    while len(out) < end:
        asked = [study.ask(dists) for _ in range(min(parallel, end - len(out)))]
        out += [dict(t.params) for t in asked]
        for t in asked:  # told in index order, never in the order the trials ended
            if t.number >= n:
                break
            v = values[t.number]
            if v is None:
                study.tell(t, state=optuna.trial.TrialState.FAIL)
            else:
                study.tell(t, float(v))
    return [{path: _plain(v) for path, v in p.items()} for p in out]


def _plain(v: Any) -> Any:
    # Optuna hands back numpy scalars from some samplers; JSON and JobSpec want Python values
    return v.item() if hasattr(v, "item") else v
