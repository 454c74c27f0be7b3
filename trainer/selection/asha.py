"""ASHA early stopping (Li et al., "A System for Massively Parallel Hyperparameter Tuning"),
adapted to a batch whose trials all start at once.

Rungs sit at min_steps * reduction_factor**k steps (below a trial's last step). A trial that reaches
a rung records its metric there and is promoted at once if it ranks in the top
floor(n / reduction_factor) of the n results recorded at that rung so far; otherwise it pauses (it
holds no device). A rung is complete when no other trial can still reach it; then its paused trials
in the top max(1, floor(n / reduction_factor)) are promoted and the rest stop. The max(1, ...) lets
the best trial of a small batch train to the end. Promotions are never taken back, as in ASHA.

Not thread-safe: the executor calls it under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["min", "max"]


@dataclass(kw_only=True, slots=True)
class AshaConfig:
    reduction_factor: int = 3
    """Keep about 1 in this many trials at each rung."""
    min_steps: int = 1
    """The first rung, in optimizer steps."""
    mode: Mode = "min"
    """Whether a lower (min) or higher (max) metric is better."""

    def __post_init__(self) -> None:
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


class Asha:
    def __init__(self, cfg: AshaConfig, *, max_steps: dict[int, int]) -> None:
        self.cfg = cfg
        self.max_steps = dict(max_steps)
        self.results: dict[int, dict[int, float]] = {}  # rung step -> trial -> metric
        self.promoted: dict[int, set[int]] = {}
        self.paused: dict[int, int] = {}  # trial -> rung step it waits at
        self.stopped: set[int] = set()
        self.gone: dict[int, int] = {}  # trial -> last step, once finished or stopped
        self.start: dict[int, int] = {}  # trial -> step it resumed from (its earlier rungs are past)

    def rungs(self, trial: int) -> list[int]:
        out, r = [], self.cfg.min_steps
        while r < self.max_steps[trial]:
            out.append(r)
            r *= self.cfg.reduction_factor
        return out

    def is_rung(self, trial: int, step: int) -> bool:
        return step in self.rungs(trial)

    def _ranked(self, rung: int) -> list[int]:
        sign = 1.0 if self.cfg.mode == "min" else -1.0
        res = self.results.get(rung, {})
        return sorted(res, key=lambda i: (sign * res[i], i))

    def report(self, trial: int, *, step: int, value: float) -> Decisions:
        """Trial `trial` reached rung `step` with metric `value`. Returns every decision this makes:
        the trial itself is in `promoted` (go on) or in neither list (paused at the rung)."""
        assert self.is_rung(trial, step), f"step {step} is not a rung of trial {trial}"
        self.results.setdefault(step, {})[trial] = value
        self.paused[trial] = step
        return self._settle()

    def resumed(self, trial: int, *, step: int) -> None:
        """Trial `trial` resumes at `step` from a checkpoint: it will not report the rungs below, so
        they must not wait for it."""
        self.start[trial] = step

    def finished(self, trial: int, *, step: int) -> Decisions:
        """Trial `trial` ended at `step` (trained to the end, failed or was stopped from outside): it
        will reach no further rung, which can complete one."""
        self.gone[trial] = step
        self.paused.pop(trial, None)
        return self._settle()

    def _complete(self, rung: int) -> bool:
        """No trial can still reach `rung`."""
        for t, max_steps in self.max_steps.items():
            if max_steps <= rung or t in self.results.get(rung, {}) or self.start.get(t, 0) >= rung:
                continue
            if t in self.gone or t in self.stopped:
                continue
            return False
        return True

    def _settle(self) -> Decisions:
        out = Decisions()
        changed = True
        while changed:  # a stop can complete a higher rung
            changed = False
            for trial, rung in sorted(self.paused.items()):
                ranked = self._ranked(rung)
                n = len(ranked)
                done = self._complete(rung)
                keep = max(1, n // self.cfg.reduction_factor) if done else n // self.cfg.reduction_factor
                promoted = self.promoted.setdefault(rung, set())
                if trial in ranked[:keep]:
                    promoted.add(trial)
                    del self.paused[trial]
                    out.promoted.append(trial)
                    changed = True
                elif done:
                    del self.paused[trial]
                    self.stopped.add(trial)
                    self.gone[trial] = rung
                    out.stopped.append(trial)
                    changed = True
        return out
