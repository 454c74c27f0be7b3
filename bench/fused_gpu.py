"""Horizontal fusion on one CUDA device: bench.peer's grid through the executor, fused beside unfused.

    python -m bench.fused_gpu [--reps 2] [--steps 60] [--warmup-steps 2]    (needs CUDA)
    python -m bench.fused_gpu --device cpu --steps 4 --reps 1              (a smoke test, writes nothing)

The trials: bench.peer's 8-trial grid (`train.lr` 4 values x `model.layers` 2 values on the built-in
GPT, val_loss every 10 steps, FIFO, no checkpoints), run by `python -m trainer.selection --devices 1
--device cuda` (bench.peer's run_executor: a fresh process as a user would start it, its wall timed
from the start of the process to its end, so each run includes its imports and CUDA's start), two
sides per repetition, in alternating order (fused first in even repetitions, unfused first in odd):

- fused: the batch as users send it (fusion on, the default): the executor measures the step costs
  its plan needs and fuses the same-architecture trials where the plan says it pays
  (trainer/selection/fusion_plan.py, trainer/selection/fused.py);
- unfused: the same batch with `"fuse": false` (every trial alone).

One untimed warm-up run of the batch (--warmup-steps, 0 for none) comes first, so neither side pays
for a cold machine's file cache. Reports per side the median wall seconds, the ratio unfused/fused,
the best trial (which must be the same on both sides and in every run), which trials trained fused
and with whom (the batch result's `fused_with`), and the largest difference between a trial's fused
and unfused training loss at the same step in the same repetition (the executor's metric lines;
fusion promises 1e-5 on CPU; on CUDA the tests allow 1e-4 on parameters: the number is reported,
with whether it is <= 1e-5). Writes bench/results/fused_gpu.json with the machine; with --device cpu
the table is printed and nothing is written (CPU numbers are not this benchmark).

Without CUDA it exits 2 unless --device cpu is given. The default run (60 steps, 2 repetitions, the
warm-up) is sized to stay under about two minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import add_results_option, table, write_results
from bench.peer import best_of, run_executor, trials

SIDES = ("fused", "unfused")
TOLERANCE = 1e-5
"""Fusion's promise on CPU: a fused trial's loss curve within this of the trial alone."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.fused_gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of both sides")
    ap.add_argument("--steps", type=int, default=60, help="training steps of every trial")
    ap.add_argument(
        "--warmup-steps", type=int, default=2, help="steps of the untimed warm-up run first (0: no warm-up)"
    )
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke test of the bench itself; prints the table, writes no results",
    )
    add_results_option(ap, default="fused_gpu", flag="--out")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.warmup_steps < 0:
        ap.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    return args


def device_problem(device: str) -> str | None:
    """Why the bench cannot run on `device` here (None: it can)."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return (
            "bench.fused_gpu needs a CUDA device and this machine has none "
            "(torch.cuda.is_available() is False); `--device cpu` runs a smoke test that writes no results"
        )
    return None


def order(rep: int) -> tuple[str, ...]:
    """The sides of repetition `rep` in the order they run: fused first in even ones."""
    return SIDES if rep % 2 == 0 else SIDES[::-1]


def grid(steps: int, device: str) -> list[dict[str, Any]]:
    """bench.peer's trials, their specs asking for `device` (the executor's --device decides where
    they run; the spec says what a user on that device would send)."""
    ts = trials(steps)
    for t in ts:
        t["spec"]["resources"] = {**t["spec"].get("resources", {}), "device": device}
    return ts


def one_run(side: str, rep: int, ts: list[dict[str, Any]], tmp: Path, device: str) -> dict[str, Any]:
    out = run_executor(ts, "fifo", tmp, fuse=side == "fused", device=device, devices=1, curves=True)
    out.update(side=side, rep=rep, best=best_of(out["trials"], {t["index"]: t["params"] for t in ts}))
    b = out["best"]
    print(
        f"rep {rep} {side:7s}: {out['wall_s']:7.2f} s  best trial {b['trial']} {b['params']} "
        f"val_loss {b['val_loss']:.6f}",
        flush=True,
    )
    return out


def fused_groups(run: dict[str, Any]) -> list[list[int]]:
    """The stacks one run trained (each trial with its `fused_with`), sorted; trials alone left out."""
    groups = {
        tuple(sorted({int(i), *map(int, t["fused_with"])}))
        for i, t in run["trials"].items()
        if t.get("fused_with")
    }
    return [list(g) for g in sorted(groups)]


def curve_diff(a: dict[int, dict[int, float]], b: dict[int, dict[int, float]]) -> dict[str, Any]:
    """The largest |a - b| per trial over the steps both curves have, and whether every trial has
    the same steps on both sides."""
    per = {
        i: max((abs(a[i][s] - b[i][s]) for s in a[i].keys() & b[i].keys()), default=0.0)
        for i in sorted(a.keys() & b.keys())
    }
    same = a.keys() == b.keys() and all(a[i].keys() == b[i].keys() for i in a)
    points = sum(len(a[i].keys() & b[i].keys()) for i in per)
    return {"per_trial": per, "max": max(per.values(), default=0.0), "same_steps": same, "points": points}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per side: median wall, best trial; unfused/fused; the stacks; the curves fused vs unfused."""
    med = {
        s: statistics.median(r["wall_s"] for r in runs if r["side"] == s)
        for s in SIDES
        if any(r["side"] == s for r in runs)
    }
    bests = {r["best"]["trial"] for r in runs}
    rows = []
    for side in med:
        rs = [r for r in runs if r["side"] == side]
        b = rs[0]["best"]
        trained_fused = [sum(bool(t.get("fused_with")) for t in r["trials"].values()) for r in rs]
        rows.append(
            {
                "side": side,
                "wall s (median)": med[side],
                "runs": len(rs),
                "best trial": b["trial"],
                "best params": json.dumps(b["params"]),
                "best val_loss": f"{b['val_loss']:.6f}",
                "same best every run": len({r["best"]["trial"] for r in rs}) == 1,
                "trials fused (per run)": ",".join(map(str, trained_fused)),
            }
        )
    by_rep: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_rep.setdefault(r["rep"], {})[r["side"]] = r
    diffs = {
        rep: curve_diff(sides["fused"]["curves"], sides["unfused"]["curves"])
        for rep, sides in sorted(by_rep.items())
        if "fused" in sides and "unfused" in sides
    }
    ratios = {
        rep: sides["unfused"]["wall_s"] / sides["fused"]["wall_s"]
        for rep, sides in sorted(by_rep.items())
        if "fused" in sides and "unfused" in sides
    }
    # no step compared (no metric lines) is no evidence: None, never "within"
    max_diff = max((d["max"] for d in diffs.values() if d["points"]), default=None)
    return {
        "rows": rows,
        "medians": med,
        "unfused_over_fused": med["unfused"] / med["fused"] if len(med) == 2 else None,
        "unfused_over_fused_per_rep": ratios,
        "same_best": len(bests) == 1,
        "bests": sorted(bests),
        "fused_groups": {r["rep"]: fused_groups(r) for r in runs if r["side"] == "fused"},
        "unfused_fused_any": any(fused_groups(r) for r in runs if r["side"] == "unfused"),
        "curve_diff_per_rep": diffs,
        "curve_max_diff": max_diff,
        "curves_within_1e-5": max_diff is not None and max_diff <= TOLERANCE,
        "curves_same_steps": all(d["same_steps"] for d in diffs.values()) if diffs else None,
    }


def report(summary: dict[str, Any], *, reps: int) -> str:
    lines = [table(summary["rows"], title=f"\nmedians over {reps} interleaved repetitions")]
    r = summary["unfused_over_fused"]
    if r is not None:
        each = ", ".join(f"{x:.3f}" for x in summary["unfused_over_fused_per_rep"].values())
        lines.append(f"unfused / fused wall (medians): {r:.3f} (per repetition: {each})")
    lines.append(f"same best trial both ways and in every run: {summary['same_best']} ({summary['bests']})")
    for rep, groups in summary["fused_groups"].items():
        lines.append(f"rep {rep} fused stacks: {groups if groups else 'none (every trial alone)'}")
    if summary["unfused_fused_any"]:
        lines.append("WARNING: a fuse:false run reported fused_with")
    if summary["curve_max_diff"] is not None:
        lines.append(
            f"loss curves fused vs unfused: max |diff| {summary['curve_max_diff']:.3e} over every trial and "
            f"step, <= 1e-5: {summary['curves_within_1e-5']}, same steps: {summary['curves_same_steps']}"
        )
    else:
        lines.append("loss curves fused vs unfused: nothing to compare (no loss metric lines)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = device_problem(args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    ts = grid(args.steps, args.device)
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-fused-gpu-") as tmpdir:
        tmp = Path(tmpdir)
        warmup_s = None
        if args.warmup_steps:
            w0 = time.perf_counter()
            run_executor(
                grid(args.warmup_steps, args.device), "fifo", tmp, fuse=True, device=args.device, devices=1
            )
            warmup_s = time.perf_counter() - w0
            print(f"warm-up ({args.warmup_steps} steps, untimed): {warmup_s:.2f} s", flush=True)
        for rep in range(args.reps):
            for side in order(rep):
                runs.append(one_run(side, rep, ts, tmp, args.device))
    elapsed = time.perf_counter() - t0
    summary = summarize(runs)
    print(report(summary, reps=args.reps))
    print(f"elapsed {elapsed:.1f} s")
    if args.device == "cpu":
        print("--device cpu: a smoke test; no results written")
        return 0
    payload = {
        "device": f"{args.device}:0",
        "trials": len(ts),
        "steps": args.steps,
        "reps": args.reps,
        "warmup_steps": args.warmup_steps,
        "warmup_s": warmup_s,
        "elapsed_s": elapsed,
        "command": "python -m bench.fused_gpu " + " ".join(sys.argv[1:] if argv is None else argv),
        "summary": summary,
        "runs": runs,
    }
    print(f"wrote {write_results(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
