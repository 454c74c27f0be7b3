"""Two jobs at once on one worker (`--concurrency 2`), each run keeping its torch threads to its
share of the cores (the default) or using every core (torch's default, what every run did before).

`python -m bench.run_cores [--reps 3] [--steps 100]`. Two embedded stacks, one worker each with
`--concurrency 2`, run side by side: `share` (SHARDYARD_TRAINER_CORES=0, the default: each run
gets the cores over the worker's concurrency, workers/cores.py) and `all-cores`
(SHARDYARD_TRAINER_CORES set to this machine's cores, so each run keeps a thread per core). Each
repetition submits the same pair of jobs through REST to each stack in turn (order alternating
between repetitions): the built-in GPT of bench.peer (2 layers, learning rates 1e-3 and 3e-3).
Reported per side, medians: the pair's wall (the first job's created_at to the last
finished_at, the server's clock), each job's run (started_at to finished_at), and the jobs'
final val_loss, which thread counts may change in the last digits. Results:
bench/results/run_cores.json.
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

SIDES = ("share", "all-cores")


def _spec(steps: int, lr: float, name: str) -> dict[str, Any]:
    spec = base_spec(steps)
    return {**spec, "name": name, "train": {**spec["train"], "lr": lr}}


def _pair(client: httpx.Client, steps: int, tag: str) -> dict[str, Any]:
    """The pair of jobs submitted at once; their times and final val_loss once both ended."""
    ids = [
        client.post("/api/jobs", json=_spec(steps, lr, f"{tag}-{lr:g}")).json()["id"] for lr in (1e-3, 3e-3)
    ]
    deadline = time.monotonic() + 900
    while True:
        jobs = [client.get(f"/api/jobs/{i}").json() for i in ids]
        if all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pair did not end: {[j['status'] for j in jobs]}")
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
    load_before = os.getloadavg()
    samples: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-cores-") as d:
        stacks: dict[str, Stack] = {}
        clients: dict[str, httpx.Client] = {}
        try:
            for side in SIDES:
                (Path(d) / side).mkdir()
                value = "0" if side == "share" else str(cores)
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
            for rep in range(args.reps):
                for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                    got = _pair(clients[side], args.steps, f"{side}-{rep}")
                    samples[side].append(got)
                    print(
                        f"rep {rep} {side}: pair {got['wall_s']:.2f} s, runs "
                        + ", ".join(f"{r:.2f}" for r in got["run_s"])
                        + " s, val_loss "
                        + ", ".join(f"{v:.6f}" for v in got["val_loss"]),
                        flush=True,
                    )
        finally:
            for c in clients.values():
                c.close()
            for st in stacks.values():
                st.stop()
    rows = [
        {
            "side": side,
            "threads a run": max(1, cores // 2) if side == "share" else cores,
            "pair wall s": statistics.median(s["wall_s"] for s in samples[side]),
            "a job's run s": statistics.median(r for s in samples[side] for r in s["run_s"]),
            "val_loss (lr 1e-3, 3e-3)": ", ".join(f"{v:.6f}" for v in samples[side][0]["val_loss"]),
        }
        for side in SIDES
    ]
    ratio = rows[1]["pair wall s"] / rows[0]["pair wall s"]
    print(table(rows, title=f"two jobs at once on a worker with --concurrency 2 (medians of {args.reps})"))
    print(f"all-cores / share, the pair's wall: {ratio:.2f}x")
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
            "samples": samples,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
