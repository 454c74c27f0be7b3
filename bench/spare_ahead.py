"""Two sandboxed jobs back to back on one pool process, the next spare started at the first run's
end or as soon as it took its spare (Settings.spare_ahead: never, always).

`python -m bench.spare_ahead [--reps 5] [--steps 300] [--gpu]`. Each repetition, for each mode in
turn (then the reverse order, so that a shared machine's load falls on both), does what a worker
pool process does with the real spare pool (workers/spare.py `prestart`, `take`, `replenish`):
its spare made ready as an idle worker's is; a first job takes it (with `start_next` where the
mode says so) and runs; the moment that run ends, its spare's leftovers go and a second job takes
whatever the pool holds. Reported: the second job's seconds from that moment to its first step
(with `never` it waits for the imports of a spare started only then), and the first job's wall
(what a spare's imports beside the run cost it: on a CPU box whose trainer uses every core, more;
on a GPU run, whose cores wait on the device, about nothing). Medians, with the load average
before and after. Results: bench/results/spare_ahead.json; with `--gpu` the jobs train on CUDA
and write spare_ahead_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import table, write_results
from bench.warm import SPEC
from core.settings import Settings
from workers import spare
from workers.execute import trainer_command
from workers.sandbox import Sandbox, probe
from workers.supervise import Outcome, run_unattended

MODES = ("never", "always")


def _run(settings: Settings, folder: Path, spec: dict[str, Any], *, start_next: bool) -> dict[str, float]:
    """One job as a pool process runs it: takes the pool's spare (adopted as `folder`), runs,
    and the pool is replenished at its end. Seconds from the call to its first step and its end."""
    t0 = time.perf_counter()
    used = spare.take(settings, folder, fits=True, start_next=start_next)
    if used is None:
        raise RuntimeError("the pool held no spare")
    (folder / "spec.json").write_text(json.dumps(spec))
    cmd = trainer_command(
        world_size=1, spec_path=folder / "spec.json", ckpt_dir=folder / "ckpt", stop_file=folder / "stop"
    )
    first: list[float] = []

    def on_message(msg: Any) -> None:
        if not first and msg.kind == "metric" and msg.step >= 1:
            first.append(time.perf_counter() - t0)

    out = Outcome()
    try:
        rc = run_unattended(
            cmd,
            folder,
            grace_s=10,
            out=out,
            on_message=on_message,
            sandbox=Sandbox(settings=settings, read_write=[folder]),
            spare=used,
        )
    finally:
        spare.replenish(settings, used)
    if rc != 0 or not first:
        raise RuntimeError(f"run failed ({rc}): {out.failure(rc)}")
    return {"first_step_s": first[0], "wall_s": time.perf_counter() - t0}


def back_to_back(root: Path, mode: str, spec: dict[str, Any], tag: str) -> dict[str, float]:
    """One repetition of `mode`: a first job, then a second the moment the first has ended."""
    data = root / tag
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data / 'unused.db'}", spare_ahead=mode)
    if not spare.prestart(settings):
        raise RuntimeError("spares need the sandbox and warm runs on")
    try:
        pool = spare._POOL.spare
        if pool is None or not pool.wait_ready(300):
            raise RuntimeError("the first spare did not get ready")
        resources = spec.get("resources", {})
        ahead = spare.ahead(settings, gpus=resources.get("gpus", 0), device=resources.get("device", "auto"))
        first = _run(settings, data / "jobs" / "1", spec, start_next=ahead)
        second = _run(settings, data / "jobs" / "2", spec, start_next=ahead)
    finally:
        spare.shutdown()
    return {
        "first_wall_s": first["wall_s"],
        "second_first_step_s": second["first_step_s"],
        "second_wall_s": second["wall_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--steps", type=int, default=300, help="each job's steps (the first must outlast a spare's imports)"
    )
    ap.add_argument(
        "--gpu", action="store_true", help="train on CUDA (needs it); writes spare_ahead_gpu.json"
    )
    args = ap.parse_args()
    if (why := probe()) is not None:
        raise SystemExit(f"spares need bubblewrap, which cannot run here: {why}")
    spec: dict[str, Any] = {**SPEC, "train": {**SPEC["train"], "steps": args.steps, "eval_every": args.steps}}
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device; this machine has none")
        spec["resources"] = {"device": "cuda"}
    load_before = os.getloadavg()
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for mode in order:
                got = back_to_back(Path(d), mode, spec, f"{mode}-{rep}")
                samples[mode].append(got)
                print(f"rep {rep} {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    rows = [
        {
            "next spare started": "at the run's end (never)"
            if mode == "never"
            else "at the run's start (always)",
            "second job's first step s": statistics.median(s["second_first_step_s"] for s in samples[mode]),
            "first job's wall s": statistics.median(s["first_wall_s"] for s in samples[mode]),
            "second job's wall s": statistics.median(s["second_wall_s"] for s in samples[mode]),
        }
        for mode in MODES
    ]
    print(table(rows, title="two sandboxed jobs back to back on one pool process (medians)"))
    path = write_results(
        "spare_ahead_gpu" if args.gpu else "spare_ahead",
        {
            "command": "python -m bench.spare_ahead "
            + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "gpu")
            + (" --gpu" if args.gpu else ""),
            "steps": args.steps,
            "spec": spec,
            "reps": args.reps,
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "rows": rows,
            "samples": samples,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
