"""Search-space expansion: a base JobSpec and a space over dotted JobSpec paths -> the trials.

    space = {"train.lr": {"low": 1e-4, "high": 3e-3, "log": true}, "model.layers": [4, 8, 12]}
    plans = expand(base=spec, space=space, method="random", trials=8, seed=0)
    plans[0].params   -> {"train.lr": 0.00041, "model.layers": 8}
    plans[0].spec     -> the base spec with those two paths set

A dimension is a non-empty list (a choice) or a range {"low", "high", "log": bool, "int": bool,
"num": n}; `num` is how many grid points a range gives (evenly spaced, or log-spaced with `log`).

This module imports only the standard library and the request models (jobrules/spec.py), so the
REST layer validates a space with the same code the trainer expands it with, without torch (a test
checks it). The paths a space may name are the JobSpec's own fields.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Literal, get_args

from jobrules.spec import JobSpec

Method = Literal["grid", "random"]

NOT_SEARCHED = ("env", "workspace")
"""Fields a search may not vary: a batch's trials run its base's code (the workspace, pinned to its
digest and checked to be the submitter's own at submit) in one environment (env, checked at
submit). A searched workspace would name code nobody checked the submitter may run."""


def _sections(model: Any, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """The leaves of a request model by section ("" for the top), read off the model itself."""
    out: dict[str, tuple[str, ...]] = {prefix: ()}
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        sub = next(
            (a for a in (info.annotation, *get_args(info.annotation)) if hasattr(a, "model_fields")),
            None,
        )
        if path in NOT_SEARCHED:
            continue
        if sub is None:
            out[prefix] += (name,)
        else:
            out.update(_sections(sub, path))
    return {k: v for k, v in out.items() if v}


JOBSPEC_FIELDS: dict[str, tuple[str, ...]] = _sections(JobSpec)
"""Every leaf of a JobSpec a search may set, by section (the JobSpec's own fields)."""
KNOWN_PATHS: frozenset[str] = frozenset(
    f"{section}.{name}" if section else name for section, names in JOBSPEC_FIELDS.items() for name in names
)
ENTRY_ARGS = ("model.args.", "data.args.")
"""A search may also set any keyword argument of a user entry point: `model.args.<name>`."""
MAX_TRIALS = 1024
"""A grid larger than this is refused: it is almost always a typo (a range with a huge `num`)."""
MAX_VALUE_ITEMS = 64
"""A choice's value is a scalar or a short list of scalars (`parallel.spill.cuts`); the bounds are
checked before anything is expanded, so a huge or deeply nested value costs nothing."""
MAX_STRING = 200


class SpaceError(ValueError):
    """A search space that can never run; the message names the dimension and the rule."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Choice:
    path: str
    values: tuple[Any, ...]

    def size(self) -> int:
        return len(self.values)

    def grid(self) -> list[Any]:
        return list(self.values)

    def sample(self, rng: random.Random) -> Any:
        return self.values[rng.randrange(len(self.values))]


@dataclass(kw_only=True, slots=True, frozen=True)
class Range:
    path: str
    low: float
    high: float
    log: bool = False
    integer: bool = False
    num: int | None = None

    def __post_init__(self) -> None:
        where = f"space[{self.path!r}]"
        if not self.low < self.high:
            raise SpaceError(f"{where}: low ({self.low}) must be < high ({self.high})")
        if self.log and self.low <= 0:
            raise SpaceError(f"{where}: a log range needs low > 0, got low={self.low}")
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise SpaceError(f"{where}: low and high must be finite numbers")
        if self.num is not None and self.num < 2:
            raise SpaceError(f"{where}: num must be >= 2 grid points, got {self.num}")
        if self.num is not None and self.num > MAX_TRIALS:
            raise SpaceError(f"{where}: num ({self.num}) is more than the limit of {MAX_TRIALS} grid points")

    def _at(self, u: float) -> float | int:
        """The point a fraction u in [0, 1] of the way from low to high (in log space with `log`)."""
        if self.log:
            v = math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))
        else:
            v = self.low + u * (self.high - self.low)
        return int(round(v)) if self.integer else v

    def size(self) -> int:
        return self.num or 0

    def grid(self) -> list[Any]:
        if self.num is None:
            raise SpaceError(
                f"space[{self.path!r}]: method grid needs a list or a range with num (grid points), "
                f"got the range [{self.low}, {self.high}] without num"
            )
        points = [self._at(i / (self.num - 1)) for i in range(self.num)]
        return list(dict.fromkeys(points))  # integer rounding can repeat a point

    def sample(self, rng: random.Random) -> Any:
        return self._at(rng.random())


Dimension = Choice | Range


def parse_space(space: dict[str, Any], *, known_paths: frozenset[str] = KNOWN_PATHS) -> list[Dimension]:
    """Check every dimension and return them in the space's key order."""
    if not isinstance(space, dict) or not space:
        raise SpaceError("space must be a non-empty object of dotted JobSpec paths")
    dims: list[Dimension] = []
    for path, raw in space.items():
        fixed = path.partition(".")[0]
        if fixed in NOT_SEARCHED:
            raise SpaceError(
                f"space path {path!r} may not be searched: {fixed} is fixed for the whole batch "
                f"(set it in base; every trial runs the base's workspace in one environment)"
            )
        if path.startswith(ENTRY_ARGS) and path.rpartition(".")[2].isidentifier():
            pass  # the recipe's own hyper-parameters: the entry point checks them
        elif path not in known_paths:
            section = path.rpartition(".")[0]
            near = sorted(p for p in known_paths if p.rpartition(".")[0] == section)
            hint = f"; fields under {section or 'the top level'}: {', '.join(near)}" if near else ""
            raise SpaceError(f"space path {path!r} is not a JobSpec field{hint}")
        dims.append(_parse_dimension(path, raw))
    return dims


def _parse_dimension(path: str, raw: Any) -> Dimension:
    where = f"space[{path!r}]"
    if isinstance(raw, list):
        if not raw:
            raise SpaceError(f"{where} is an empty list: a choice needs at least one value")
        if len(raw) > MAX_TRIALS:
            raise SpaceError(f"{where}: a choice has at most {MAX_TRIALS} values, got {len(raw)}")
        for value in raw:
            _check_value(where, value)
        return Choice(path=path, values=tuple(raw))
    if isinstance(raw, dict):
        extra = set(raw) - {"low", "high", "log", "int", "num"}
        if extra:
            allowed = "low, high, log, int, num"
            raise SpaceError(f"{where}: unknown range keys {sorted(extra)} (allowed: {allowed})")
        if "low" not in raw or "high" not in raw:
            raise SpaceError(f"{where}: a range needs both low and high, got keys {sorted(raw)}")
        for key in ("low", "high"):
            if isinstance(raw[key], bool) or not isinstance(raw[key], int | float):
                raise SpaceError(f"{where}: {key} must be a number, got {raw[key]!r}")
        num = raw.get("num")
        if num is not None and (isinstance(num, bool) or not isinstance(num, int)):
            raise SpaceError(f"{where}: num must be an integer, got {num!r}")
        integer = bool(raw.get("int", isinstance(raw["low"], int) and isinstance(raw["high"], int)))
        return Range(
            path=path,
            low=raw["low"],
            high=raw["high"],
            log=bool(raw.get("log", False)),
            integer=integer,
            num=num,
        )
    raise SpaceError(f"{where} must be a list of values or a range object {{low, high, ...}}, got {raw!r}")


def _is_scalar(value: Any) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if isinstance(value, str):
        return len(value) <= MAX_STRING
    return value is None or isinstance(value, bool | int | float)


def _check_value(where: str, value: Any) -> None:
    if _is_scalar(value):
        return
    if isinstance(value, list) and len(value) <= MAX_VALUE_ITEMS and all(map(_is_scalar, value)):
        return
    raise SpaceError(
        f"{where}: each value must be a number, a string of at most {MAX_STRING} characters, true/false, "
        f"null or a list of at most {MAX_VALUE_ITEMS} of those (finite numbers only)"
    )


def sample_params(
    space: dict[str, Any],
    *,
    method: Method,
    trials: int | None = None,
    seed: int = 0,
    known_paths: frozenset[str] = KNOWN_PATHS,
) -> list[dict[str, Any]]:
    """The trials' parameter dicts (dotted path -> value), in a fixed order for a given seed."""
    dims = parse_space(space, known_paths=known_paths)
    if method == "grid":
        if trials is not None:
            raise SpaceError(f"method grid takes no trials (the grid sets the count), got trials={trials}")
        # counted before any axis is built: a typo'd grid is refused without being expanded
        count = math.prod(d.size() or 1 for d in dims)
        if count > MAX_TRIALS:
            raise SpaceError(f"the grid has {count} points, more than the limit of {MAX_TRIALS} trials")
        axes = [d.grid() for d in dims]
        return [dict(zip((d.path for d in dims), point, strict=True)) for point in itertools.product(*axes)]
    if method == "random":
        if trials is None or isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            raise SpaceError(f"method random needs trials >= 1, got {trials!r}")
        if trials > MAX_TRIALS:
            raise SpaceError(f"trials ({trials}) is more than the limit of {MAX_TRIALS}")
        rng = random.Random(seed)
        return [{d.path: d.sample(rng) for d in dims} for _ in range(trials)]
    raise SpaceError(f"method must be grid or random, got {method!r}")


def apply_params(base: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of `base` with each dotted path set; missing sections are created."""
    spec = copy.deepcopy(base)
    for path, value in params.items():
        *parents, leaf = path.split(".")
        node = spec
        for i, key in enumerate(parents):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                raise SpaceError(
                    f"cannot set {path!r}: the base spec's {'.'.join(parents[: i + 1])} is {child!r}, "
                    f"not an object"
                )
            node = child
        node[leaf] = copy.deepcopy(value)
    return spec


@dataclass(kw_only=True, slots=True, frozen=True)
class TrialPlan:
    index: int
    params: dict[str, Any]
    spec: dict[str, Any]


def expand(
    *,
    base: dict[str, Any],
    space: dict[str, Any],
    method: Method,
    trials: int | None = None,
    seed: int = 0,
    first_index: int = 0,
) -> list[TrialPlan]:
    """Trials of a batch: index, params and full spec. `first_index` numbers trials added later to a
    running batch after the ones it already has."""
    if not isinstance(base, dict):
        raise SpaceError(f"the base spec must be an object, got {type(base).__name__}")
    params = sample_params(space, method=method, trials=trials, seed=seed)
    return [
        TrialPlan(index=first_index + i, params=p, spec=apply_params(base, p)) for i, p in enumerate(params)
    ]
