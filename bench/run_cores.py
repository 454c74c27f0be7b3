"""Jobs on a worker that runs two at once (`--concurrency 2`), each run keeping its torch threads
to its share of the cores (the default) or using every core.

`python -m bench.run_cores [--reps 3] [--steps 100]`. Two embedded stacks, one worker each with
`--concurrency 2`, run side by side: `share` (SHARDYARD_TRAINER_CORES=0, the default: each run
gets the worker's cores over its concurrency, workers/cores.py) and `all-cores`
(SHARDYARD_TRAINER_CORES set to this machine's cores: a thread per core in every run, torch's
default, and what a share that followed the runs beside a job would give a job alone). Each
repetition submits through REST, to each stack in turn (order alternating between repetitions),
the same pair of jobs at once, then one job alone: the built-in GPT of bench.peer (2 layers,
learning rates 1e-3 and 3e-3; the job alone 1e-3). Reported per side, medians: the wall (the first
job's created_at to the last finished_at, the server's clock), each job's run (started_at to
finished_at), and the jobs' final val_loss, which thread counts may change in the last digits.
Results: bench/results/run_cores.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from api.stack import Stack
from bench.common import table, write_results
from bench.peer import base_spec

PAIR = ("share", "all-cores")
"""The sides two jobs at once run on."""
ALONE = ("share", "all-cores")
"""The sides one job alone runs on."""


def _spec(steps: int, lr: float, name: str) -> dict[str, Any]:
    spec = base_spec(steps)
    return {**spec, "name": name, "train": {**spec["train"], "lr": lr}}


def _pair(
    client: httpx.Client, steps: int, tag: str, lrs: tuple[float, ...] = (1e-3, 3e-3)
) -> dict[str, Any]:
    """The jobs (one per learning rate) submitted at once; their times and final val_loss once
    all ended."""
    ids = [client.post("/api/jobs", json=_spec(steps, lr, f"{tag}-{lr:g}")).json()["id"] for lr in lrs]
    deadline = time.monotonic() + 900
    while True:
        jobs = [client.get(f"/api/jobs/{i}").json() for i in ids]
        if all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the jobs did not end: {[j['status'] for j in jobs]}")
        time.sleep(0.2)
    if bad := [j for j in jobs if j["status"] != "succeeded"]:
        raise RuntimeError(f"a job did not succeed: {bad[0]['status']} {bad[0]['error']}")

    def at(j: dict[str, Any], key: str) -> float:
        return datetime.fromisoformat(j[key]).timestamp()

    return {
        "wall_s": max(at(j, "finished_at") for j in jobs) - min(at(j, "created_at") for j in jobs),
        "run_s": [at(j, "finished_at") - at(j, "started_at") for j in jobs],
        "val_loss": [j["result"]["val_loss"] for j in jobs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    fixed = {"share": "0", "all-cores": str(cores)}
    load_before = os.getloadavg()
    pairs: dict[str, list[dict[str, Any]]] = {s: [] for s in PAIR}
    alone: dict[str, list[dict[str, Any]]] = {s: [] for s in ALONE}
    with tempfile.TemporaryDirectory(prefix="bench-cores-") as d:
        stacks: dict[str, Stack] = {}
        clients: dict[str, httpx.Client] = {}
        try:
            for side, value in fixed.items():
                (Path(d) / side).mkdir()
                stacks[side] = st = Stack(
                    root=Path(d) / side,
                    workers=1,
                    concurrency=2,
                    extra_env={"SHARDYARD_TRAINER_CORES": value},
                )
                st.start()
                clients[side] = httpx.Client(
                    base_url=st.base_url, timeout=60, headers={"Authorization": f"Bearer {st.admin_token}"}
                )
                _pair(clients[side], 10, f"warmup-{side}")  # the worker's pool processes take a job each

            def say(what: str, side: str, got: dict[str, Any]) -> None:
                print(
                    f"{what} {side}: wall {got['wall_s']:.2f} s, runs "
                    + ", ".join(f"{r:.2f}" for r in got["run_s"])
                    + " s, val_loss "
                    + ", ".join(f"{v:.6f}" for v in got["val_loss"]),
                    flush=True,
                )

            for rep in range(args.reps):
                for side in PAIR if rep % 2 == 0 else PAIR[::-1]:
                    pairs[side].append(got := _pair(clients[side], args.steps, f"{side}-{rep}"))
                    say(f"rep {rep} pair", side, got)
                for side in ALONE if rep % 2 == 0 else ALONE[::-1]:
                    alone[side].append(
                        got := _pair(clients[side], args.steps, f"alone-{side}-{rep}", (1e-3,))
                    )
                    say(f"rep {rep} alone", side, got)
        finally:
            for c in clients.values():
                c.close()
            for st in stacks.values():
                st.stop()

    def row(side: str, samples: list[dict[str, Any]], threads: int) -> dict[str, Any]:
        return {
            "side": side,
            "threads a run": threads,
            "wall s": statistics.median(s["wall_s"] for s in samples),
            "a job's run s": statistics.median(r for s in samples for r in s["run_s"]),
            "val_loss": ", ".join(f"{v:.6f}" for v in samples[0]["val_loss"]),
        }

    rows = [
        row("share", pairs["share"], max(1, cores // 2)),
        row("all-cores", pairs["all-cores"], cores),
    ]
    alone_rows = [
        row("share", alone["share"], max(1, cores // 2)),
        row("all-cores", alone["all-cores"], cores),
    ]
    ratio = rows[1]["wall s"] / rows[0]["wall s"]
    alone_ratio = alone_rows[1]["wall s"] / alone_rows[0]["wall s"]
    print(table(rows, title=f"two jobs at once on a worker with --concurrency 2 (medians of {args.reps})"))
    print(f"all-cores / share, the pair's wall: {ratio:.2f}x")
    print(table(alone_rows, title=f"one job alone on a worker with --concurrency 2 (medians of {args.reps})"))
    print(f"all-cores / share, the job's wall: {alone_ratio:.2f}x")
    path = write_results(
        "run_cores",
        {
            "command": f"python -m bench.run_cores --reps {args.reps} --steps {args.steps}",
            "steps": args.steps,
            "reps": args.reps,
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "rows": rows,
            "all_cores_over_share": ratio,
            "alone_rows": alone_rows,
            "all_cores_over_share_alone": alone_ratio,
            "samples": pairs,
            "alone_samples": alone,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
