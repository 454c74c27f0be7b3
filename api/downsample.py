"""Downsampling of metric series for `max_points` (Largest-Triangle-Three-Buckets, from the `lttb`
package): keeps the shape of a loss curve (spikes included) with far fewer points."""

from __future__ import annotations

import lttb
import numpy as np


def dedupe_steps(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """One value per step (the last written wins: a resumed run may re-report steps)."""
    if all(a < b for a, b in zip(steps, steps[1:], strict=False)):
        return steps, values  # already one per step, in order (what the database gives)
    last: dict[int, float] = {}
    for s, v in zip(steps, values, strict=True):
        last[s] = v
    ordered = sorted(last)
    return ordered, [last[s] for s in ordered]


def downsample(steps: list[int], values: list[float], *, max_points: int) -> tuple[list[int], list[float]]:
    steps, values = dedupe_steps(steps, values)
    if len(steps) <= max_points:
        return steps, values
    if max_points < 3:
        return steps[-max_points:], values[-max_points:]
    finite = np.isfinite(values)
    data = np.column_stack([np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)])[
        finite
    ]
    out = lttb.downsample(data, n_out=min(max_points, len(data)))
    return [int(s) for s in out[:, 0]], [float(v) for v in out[:, 1]]


def downsample_arrays(
    steps: np.ndarray, values: np.ndarray, *, max_points: int
) -> tuple[list[int], list[float]]:
    """`downsample` of one series already one point per step, in order, held as arrays (the
    per-job series cache, api/series.py): no lists to convert on every read."""
    if len(steps) <= max_points:
        return steps.tolist(), values.tolist()
    if max_points < 3:
        return steps[-max_points:].tolist(), values[-max_points:].tolist()
    finite = np.isfinite(values)
    data = np.column_stack([steps.astype(np.float64), values])[finite]
    out = lttb.downsample(data, n_out=min(max_points, len(data)))
    return [int(s) for s in out[:, 0]], [float(v) for v in out[:, 1]]
