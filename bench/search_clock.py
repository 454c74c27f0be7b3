"""A sampler batch's ask rules on paper: how long bench.peer --search's TPE batch takes, over the work
it holds, when trials are told in index order, by the logical clock, and by the clock with the last
trial asked early (core/search.py TAIL).

    python -m bench.search_clock [--seeds 40] [--ratio 1.85] [--out search_clock]

No training: each trial's real work is 1 (2 layers) or `--ratio` (4 layers; the clock itself
estimates 1.83 from the trials' flops, jobrules/sizing.py), and its value is the one bench.peer's
grid measured for that point. The "real" run is the executor's rule in the fluid limit (longest work
left first, trials with equal work left sharing the devices: core/search.py `Clock` again, with the
real costs), asking the sampler whenever a device has no trial, and adding every trial due then
(workers/search.py `ask_due`). What it leaves out is what the REST side adds: the ask's round trip,
start-up and the executor's own packing of few trials (bench.peer --search measures those). Reports
the makespan over the work floor (work / devices) per rule: median, mean and worst over the seeds.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.common import add_results_option, table, write_results
from core.search import Clock, plan

SPACE = {"train.lr": [1e-3, 3e-3, 1e-2, 3e-2], "model.layers": [2, 4]}
# bench.peer --search's grid, 100 steps: each point's best val_loss (bench/results/peer_search.json)
VALUE = {
    (0.001, 2): 2.5146,
    (0.001, 4): 2.5347,
    (0.003, 2): 2.4159,
    (0.003, 4): 2.8182,
    (0.01, 2): 2.7453,
    (0.01, 4): 2.6922,
    (0.03, 2): 3.0595,
    (0.03, 4): 2.7528,
}
ESTIMATE = {2: 1.0, 4: 1.83}
"""The clock's costs: the ratio of the two trials' flops (jobrules/sizing.py trial_flops)."""
RULES = {
    "index order": {"cost": False, "tail": 0},
    "clock": {"cost": True, "tail": 0},
    "clock, last trial early": {"cost": True, "tail": 1},
    "clock, last two early": {"cost": True, "tail": 2},
}


def run(seed: int, *, cost: bool, tail: int, ratio: float, devices: int = 2, total: int = 8) -> float:
    """The batch's makespan over its work floor under one rule."""
    work = {2: 1.0, 4: ratio}
    ended: dict[int, float] = {}
    points: list[tuple[float, int]] = []

    def due() -> list[dict[str, Any]]:
        got = plan(
            space=SPACE,
            method="tpe",
            seed=seed,
            mode="min",
            parallel=devices,
            devices=devices,
            values=ended,
            total=total,
            startup_trials=4,
            cost=(lambda p: ESTIMATE[p["model.layers"]]) if cost else None,
            tail=tail,
        )
        return [a.params for a in got.trials[len(points) :]]

    real = Clock(devices=devices, slots=total + 1)  # the executor: asks are the rule's, not its own

    def start(params: list[dict[str, Any]]) -> None:
        for p in params:
            points.append((p["train.lr"], p["model.layers"]))
            real.start(len(points) - 1, work[p["model.layers"]])

    start(due())
    while len(ended) < total:
        if len(real.left) < devices and len(points) < total and (new := due()):
            start(new)
            continue
        if not real.left:
            break
        before = len(real.ended)
        real._step()
        for j in real.ended[before:]:
            ended[j] = VALUE[points[j]]
    return real.time / (sum(work[layers] for _, layers in points) / devices)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.search_clock", description=__doc__)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--ratio", type=float, default=1.85, help="a 4-layer trial's work over a 2-layer one's")
    add_results_option(ap, default="search_clock", flag="--out")
    args = ap.parse_args()
    rows, per_seed = [], {}
    for name, rule in RULES.items():
        got = [run(seed, ratio=args.ratio, **rule) for seed in range(args.seeds)]
        per_seed[name] = got
        rows.append(
            {
                "rule": name,
                "makespan / work floor, median": statistics.median(got),
                "mean": statistics.mean(got),
                "worst": max(got),
                "seeds 0-4": " ".join(f"{x:.3f}" for x in got[:5]),
            }
        )
    print(
        table(
            rows, title=f"bench.peer --search's TPE batch on paper ({args.seeds} seeds, ratio {args.ratio})"
        )
    )
    path = write_results(
        args.out,
        {"seeds": args.seeds, "ratio": args.ratio, "estimate": ESTIMATE, "rows": rows, "per_seed": per_seed},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
