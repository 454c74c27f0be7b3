"""Cutting the model's nn.Sequential into D contiguous stages, balanced by parameter count."""

from __future__ import annotations

import copy

from torch import nn

from trainer.models import count_params
from trainer.pipeline.actions import Schedule


def partition(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Split `sizes` into `parts` non-empty contiguous ranges [lo, hi) minimising the largest sum
    (linear-partition dynamic programme; ties go to the earliest cut, so the result is stable)."""
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest max-sum cutting the first i layers into k stages
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds: list[tuple[int, int]] = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def stage_bounds(model: nn.Sequential, stages: int) -> list[tuple[int, int]]:
    return partition([count_params(layer) for layer in model], stages)


def build_stages(model: nn.Sequential, *, sched: Schedule, rank: int) -> dict[tuple[int, int], nn.Sequential]:
    """The stage modules rank `rank` holds, keyed by (stage, replica). Chimera's second copy is a
    deep copy, so both replicas start from the same weights (the model was built from one seed)."""
    bounds = stage_bounds(model, sched.stages)
    layers = list(model)
    out: dict[tuple[int, int], nn.Sequential] = {}
    for stage, replica in sched.stages_on(rank):
        lo, hi = bounds[stage]
        mod = nn.Sequential(*layers[lo:hi])
        out[(stage, replica)] = copy.deepcopy(mod) if replica == 1 else mod
    return out


def global_param_names(model: nn.Sequential, *, stages: int, stage: int) -> list[str]:
    """The full model's parameter names for a stage module's parameters, in the same order."""
    lo, hi = stage_bounds(model, stages)[stage]
    return [
        f"{lo + i}.{name}"
        for i, layer in enumerate(list(model)[lo:hi])
        for name, _ in layer.named_parameters()
    ]
