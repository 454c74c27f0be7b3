"""When a run diverged: the rule the worker applies at a job's (or a trial's) end, and the spec's
words for it (`train.divergence_factor`, `train.fail_on_divergence`).

A run diverged when its final smoothed training loss is above `factor` times its first loss: the
loss series is the job's whole one, every attempt's points (the database's, so a job resumed from a
checkpoint is judged on the run, not on its last attempt). "Final smoothed" is the mean of the last
tenth of the loss points (at least 1, at most 20), so one noisy last step neither flags a run nor
hides one. A first loss that is not a positive finite number (a user's loss may be negative) makes
no ratio, and such a run is never flagged; a final loss that is infinite is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

DEFAULT_DIVERGENCE_FACTOR = 10.0
MAX_TAIL_POINTS = 20


def _num(v: float) -> str:
    return f"{v:,.0f}" if math.isfinite(v) and abs(v) >= 1000 else f"{v:.4g}"


def tail_size(points: int) -> int:
    """How many of the last loss points the final smoothed loss averages."""
    return max(1, min(MAX_TAIL_POINTS, points // 10))


def divergence_factor(spec: dict[str, Any]) -> float:
    """The spec's train.divergence_factor; the default for a spec stored before the field existed."""
    value = (spec.get("train") or {}).get("divergence_factor")
    return DEFAULT_DIVERGENCE_FACTOR if value is None else float(value)


def fails_on_divergence(spec: dict[str, Any]) -> bool:
    return bool((spec.get("train") or {}).get("fail_on_divergence"))


def divergence(losses: Sequence[tuple[int, float]], *, factor: float) -> str | None:
    """Why the run whose training loss points are `losses` ((step, value), in step order) diverged,
    as one sentence; None when it did not (or when the rule cannot tell: fewer than two points, a
    first loss that is not positive and finite)."""
    if len(losses) < 2:
        return None
    first_step, first = losses[0]
    if not (math.isfinite(first) and first > 0):
        return None
    n = tail_size(len(losses))
    tail = [v for _, v in losses[-n:]]
    final = math.fsum(tail) / n
    if math.isfinite(final) and final <= factor * first:
        return None
    last_step = losses[-1][0]
    ratio = "an infinite multiple" if not math.isfinite(final) else f"{final / first:,.1f}x"
    return (
        f"diverged: the training loss ended at {_num(final)} (mean of the last {n} point(s), to step "
        f"{last_step}), {ratio} its first value {_num(first)} (step {first_step}); the rule flags a "
        f"final loss above {factor:g}x the first (train.divergence_factor)"
    )


def judge(spec: dict[str, Any], losses: Sequence[tuple[int, float]]) -> tuple[str | None, bool]:
    """(why the run of `spec` with these training loss points diverged, or None; whether that
    ends it `failed`, as its train.fail_on_divergence asks)."""
    why = divergence(losses, factor=divergence_factor(spec))
    return why, why is not None and fails_on_divergence(spec)
