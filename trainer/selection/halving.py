"""Early stopping by successive halving: asynchronous ASHA, synchronous successive halving (SHA) and
Hyperband brackets, with decisions that are a function of the trials' metrics and the batch's seed.

Rungs sit at min_steps * reduction_factor**k steps, below a trial's last step. A trial that reaches
a rung records its metric there and pauses (it holds no device) until the rung decides about it.

The order in which trials reach a rung is a matter of timing (which thread got a core first), so
no decision here depends on it. Each bracket has a *logical order*: its trials shuffled by
`random.Random(seed)`. Reports are processed in that order:

- ASHA (`asha`): the report of the j-th trial in logical order is taken once every trial before
  it has reported at the rung or can no longer reach it. Then every waiting trial that ranks in the
  top floor(n / rf) of the n reports taken so far at the rung is promoted. This is asynchronous
  ASHA (Li et al.) with the arrival order fixed to the logical order, so a trial need not wait for
  the whole rung, only for the trials ahead of it.
- SHA (`sha`): nothing is promoted before the rung is complete.
- Hyperband (`hyperband`): the trials are split into brackets s = s_max..0 in proportion to
  Hyperband's n_s = ceil((s_max + 1) * rf**s / (s + 1)); bracket s runs SHA over the last s rungs of
  the ladder (bracket s_max starts at min_steps, bracket 0 trains every trial to its end).

A rung is complete when no trial of its bracket can still reach it. Then its waiting trials in the
top max(1, floor(n / rf)) are promoted and the rest stop, each with a `StopReason` (its rung, its
value, the rung's cut-off: the value of the last kept trial). The max(1, ...) lets the best trial of
a small bracket train to the end. Promotions are never taken back. Ties rank by logical order.

Not thread-safe: the executor calls it under its own lock.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from jobrules.spec import STOPPING_KINDS, EarlyStoppingSpec, StoppingKind
from jobrules.stopping import StopReason

Mode = Literal["min", "max"]
_REQUEST = EarlyStoppingSpec()
"""The request's defaults (jobrules/spec.py), for rungs built without one."""


@dataclass(kw_only=True, slots=True)
class HalvingConfig:
    kind: StoppingKind = _REQUEST.kind
    reduction_factor: int = _REQUEST.reduction_factor
    """Keep about 1 in this many trials at each rung."""
    min_steps: int = _REQUEST.min_steps
    """The first rung, in optimizer steps."""
    mode: Mode = "min"
    """Whether a lower (min) or higher (max) metric is better."""
    seed: int = 0
    """Seeds the logical order of the trials (and Hyperband's split into brackets)."""

    def __post_init__(self) -> None:
        if self.kind not in STOPPING_KINDS:
            raise ValueError(
                f"early_stopping.kind must be one of {', '.join(STOPPING_KINDS)}, got {self.kind!r}"
            )
        if self.reduction_factor < 2:
            raise ValueError(f"early_stopping.reduction_factor must be >= 2, got {self.reduction_factor}")
        if self.min_steps < 1:
            raise ValueError(f"early_stopping.min_steps must be >= 1, got {self.min_steps}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be min or max, got {self.mode!r}")


@dataclass(kw_only=True, slots=True)
class Decisions:
    promoted: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    reasons: dict[int, StopReason] = field(default_factory=dict)

    def extend(self, other: Decisions) -> None:
        self.promoted += other.promoted
        self.stopped += other.stopped
        self.reasons.update(other.reasons)


def ladder(*, min_steps: int, reduction_factor: int, max_steps: int) -> list[int]:
    """Every rung step below `max_steps`: min_steps * rf**k."""
    out, r = [], min_steps
    while r < max_steps:
        out.append(r)
        r *= reduction_factor
    return out


def hyperband_sizes(trials: int, *, s_max: int, reduction_factor: int) -> list[int]:
    """How many of `trials` go to each bracket s = s_max..0 (index 0 is s_max): Hyperband's
    n_s = ceil((s_max + 1) * rf**s / (s + 1)), scaled to the batch by largest remainder."""
    weights = [math.ceil((s_max + 1) * reduction_factor**s / (s + 1)) for s in range(s_max, -1, -1)]
    total = sum(weights)
    exact = [trials * w / total for w in weights]
    sizes = [math.floor(x) for x in exact]
    # the largest remainders get the trials left over; ties to the more aggressive bracket
    for b in sorted(range(len(weights)), key=lambda b: (-(exact[b] - sizes[b]), b))[: trials - sum(sizes)]:
        sizes[b] += 1
    return sizes


class Halving:
    """The rung decisions of one batch. `max_steps` gives every trial's last step."""

    def __init__(self, cfg: HalvingConfig, *, max_steps: dict[int, int]) -> None:
        self.cfg = cfg
        self.max_steps = dict(max_steps)
        order = sorted(self.max_steps)
        random.Random(cfg.seed).shuffle(order)
        self.order = order
        """The logical order: reports at a rung are taken in this order, never in arrival order."""
        top = max(self.max_steps.values(), default=0)
        self.ladder = ladder(min_steps=cfg.min_steps, reduction_factor=cfg.reduction_factor, max_steps=top)
        self.bracket: dict[int, int] = {}
        """Trial -> bracket s (the number of rungs it may stop at); ASHA and SHA: one bracket."""
        if cfg.kind == "hyperband":
            s_max = len(self.ladder)
            sizes = hyperband_sizes(len(order), s_max=s_max, reduction_factor=cfg.reduction_factor)
            it = iter(order)
            for b, n in enumerate(sizes):
                for _ in range(n):
                    self.bracket[next(it)] = s_max - b
        else:
            self.bracket = dict.fromkeys(order, len(self.ladder))
        self.pending: dict[int, int] = {}  # trial -> rung it reported at, not yet taken in order
        self.pending_value: dict[int, float] = {}
        self.waiting: dict[int, int] = {}  # trial -> rung it waits at, taken but not promoted
        self.results: dict[tuple[int, int], dict[int, float]] = {}  # (bracket, rung) -> trial -> value
        self.promoted: dict[tuple[int, int], set[int]] = {}
        self.stopped: dict[int, StopReason] = {}
        self.gone: dict[int, int] = {}  # trial -> last step, once finished or stopped
        self.start: dict[int, int] = {}  # trial -> step it resumed from (its earlier rungs are past)

    # -- the ladder ------------------------------------------------------------------------------

    def rungs(self, trial: int) -> list[int]:
        s = self.bracket[trial]
        own = self.ladder[len(self.ladder) - s :] if s else []
        return [r for r in own if r < self.max_steps[trial]]

    def is_rung(self, trial: int, step: int) -> bool:
        return step in self.rungs(trial)

    def _members(self, b: int) -> list[int]:
        return [t for t in self.order if self.bracket[t] == b]

    def _ranked(self, key: tuple[int, int]) -> list[int]:
        sign = 1.0 if self.cfg.mode == "min" else -1.0
        res = self.results.get(key, {})
        pos = {t: n for n, t in enumerate(self.order)}
        return sorted(res, key=lambda t: (sign * res[t], pos[t]))

    def _can_reach(self, trial: int, rung: int) -> bool:
        return (
            rung in self.rungs(trial)
            and trial not in self.gone
            and self.start.get(trial, 0) < rung
            and trial not in self.results.get((self.bracket[trial], rung), {})
        )

    # -- what the executor tells it --------------------------------------------------------------

    def report(self, trial: int, *, step: int, value: float) -> Decisions:
        """Trial `trial` reached rung `step` with metric `value` and pauses there. Returns every
        decision this makes possible; the trial itself is in `promoted` (go on), in `stopped`, or
        in neither (it waits)."""
        assert self.is_rung(trial, step), f"step {step} is not a rung of trial {trial}"
        self.pending[trial] = step
        self.pending_value[trial] = value
        return self._settle()

    def resumed(self, trial: int, *, step: int) -> None:
        """Trial `trial` resumes at `step` from a checkpoint: it will not report the rungs below, so
        they must not wait for it."""
        self.start[trial] = step

    def finished(self, trial: int, *, step: int) -> Decisions:
        """Trial `trial` ended at `step` (trained to the end, failed or was stopped from outside): it
        will reach no further rung, which can complete one."""
        self.gone[trial] = step
        self.pending.pop(trial, None)
        self.pending_value.pop(trial, None)
        self.waiting.pop(trial, None)
        return self._settle()

    def paused(self) -> set[int]:
        return set(self.pending) | set(self.waiting)

    def blocking(self) -> set[int]:
        """Trials that paused trials wait for: those that can still reach a rung at which some
        trial is paused. Running them first gets the paused trials decided sooner, so fewer
        devices idle; this is scheduling only, the decisions never depend on it."""
        paused = {**self.pending, **self.waiting}
        held = {(self.bracket[t], r) for t, r in paused.items()}
        return {
            t for b, rung in held for t in self._members(b) if t not in paused and self._can_reach(t, rung)
        }

    # -- the decisions ---------------------------------------------------------------------------

    def _take_in_order(self, b: int, rung: int, out: Decisions) -> bool:
        """Take the pending reports at (b, rung) that are next in logical order. True if any."""
        key = (b, rung)
        took = False
        for t in self._members(b):
            if self.pending.get(t) == rung:
                del self.pending[t]
                self.results.setdefault(key, {})[t] = self.pending_value.pop(t)
                self.waiting[t] = rung
                took = True
                if self.cfg.kind == "asha":
                    # ASHA: every waiting trial now in the top floor(n / rf) goes on
                    ranked = self._ranked(key)
                    for u in ranked[: len(ranked) // self.cfg.reduction_factor]:
                        if self.waiting.get(u) == rung and self.bracket[u] == b:
                            del self.waiting[u]
                            self.promoted.setdefault(key, set()).add(u)
                            out.promoted.append(u)
            elif self._can_reach(t, rung):
                break  # this trial's report comes first; the ones after it wait for it
        return took

    def _complete(self, b: int, rung: int) -> bool:
        return not any(self._can_reach(t, rung) for t in self._members(b))

    def _close(self, b: int, rung: int, out: Decisions) -> bool:
        """The rung is complete: promote its waiting trials in the top max(1, n // rf), stop the
        rest. True if anything changed."""
        key = (b, rung)
        here = [t for t, r in self.waiting.items() if r == rung and self.bracket[t] == b]
        if not here or not self._complete(b, rung):
            return False
        ranked = self._ranked(key)
        keep = max(1, len(ranked) // self.cfg.reduction_factor)
        cutoff = self.results[key][ranked[keep - 1]]
        for t in sorted(here, key=ranked.index):
            del self.waiting[t]
            if t in ranked[:keep]:
                self.promoted.setdefault(key, set()).add(t)
                out.promoted.append(t)
            else:
                reason = StopReason(
                    rung=rung, value=self.results[key][t], cutoff=cutoff, kept=keep, of=len(ranked), bracket=b
                )
                self.stopped[t] = reason
                self.gone[t] = rung
                out.stopped.append(t)
                out.reasons[t] = reason
        return True

    def _settle(self) -> Decisions:
        out = Decisions()
        changed = True
        while changed:  # a stop can complete a rung, and a rung's decisions can free the next
            changed = False
            for b in sorted(set(self.bracket.values())):
                for rung in self.ladder:
                    changed |= self._take_in_order(b, rung, out)
                    changed |= self._close(b, rung, out)
        return out

    def decisions_of(self, trials: Iterable[int]) -> dict[int, dict[str, object]]:
        """Per trial: its bracket, the rungs it passed, and its stop reason if it was stopped."""
        out: dict[int, dict[str, object]] = {}
        for t in trials:
            passed = sorted(r for (b, r), ts in self.promoted.items() if t in ts)
            out[t] = {
                "bracket": self.bracket[t],
                "promoted_at": passed,
                "stop": self.stopped[t].as_dict() if t in self.stopped else None,
            }
        return out
