"""Slurm launcher start: submit -> first training step of the same tiny job on a Slurm pool and on a
Celery worker, same stack, same machine, as a ratio.

One embedded stack (redis-server, the API with its scheduler, one Celery worker with the default
settings) and a Slurm pool's submitter (`python -m workers.slurm_pool`, one node of 2 slots) on a
real two-node Slurm cluster on this machine (tests/slurm/cluster.sh --up; started here and stopped
at the end unless SLURM_CONF already names one; needs root, as `make test-slurm`). The same job (the
built-in GPT, a few steps) is submitted `--reps` times to each, interleaved (celery, slurm, celery,
...), one at a time, each waited for to its end.

Steering: the scheduler places a job on the live launcher with the least room that holds it
(core/scheduler.py `_place`); the pool's node (2 slots) has less than the worker (4 per core), so
while the submitter beats the job goes to Slurm. For a Celery run the submitter is paused (SIGSTOP)
until its node is no longer live (`SHARDYARD_WORKER_ALIVE_S`, short here), then resumed (SIGCONT)
for the next Slurm run; every run checks where its job ran.

Measured on the server's clock: submit (the job's `created_at`, REST) -> its first `loss` point (the
trainer's time of the point, metric_points, read-only from the stack's database: the REST series
carry steps, not times). For the Slurm runs the job's log (REST events) splits it: submit -> "slurm
job N submitted" (scheduler + the submitter's poll + sbatch), -> "slurm job N started on n1" (Slurm's
scheduling + srun + the agent's Python start), -> the first loss (claim, trainer start, first step).

    nice -n 10 python -m bench.slurm_start [--reps 3] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from api.stack import Stack
from bench.common import table, write_results

ROOT = Path(__file__).resolve().parent.parent
ALIVE_S = 4.0


def spec(steps: int) -> dict[str, Any]:
    return {
        "name": "bench-slurm-start",
        "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 32},
        "data": {"max_chars": 200_000},
        "train": {"steps": steps, "batch_size": 8, "lr": 3e-3, "eval_every": steps, "seed": 0},
    }


def _utc(s: str) -> float:
    d = datetime.fromisoformat(s)
    return (d if d.tzinfo else d.replace(tzinfo=UTC)).timestamp()


# ---- the Slurm cluster --------------------------------------------------------------------------


def cluster_up() -> Path:
    """tests/slurm/cluster.sh --up: its slurm.conf (the state folder is its parent)."""
    got = subprocess.run(
        ["bash", str(ROOT / "tests" / "slurm" / "cluster.sh"), "--up"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if got.returncode != 0:
        raise RuntimeError(f"cluster.sh --up failed:\n{got.stdout}\n{got.stderr}")
    line = next(ln for ln in got.stdout.splitlines() if ln.startswith("export SLURM_CONF="))
    return Path(line.split("=", 1)[1].strip())


def cluster_down(conf: Path) -> None:
    """As cluster.sh's stop_all: every pid in <state>/pids, newest first, TERM then KILL; the
    state folder removed."""
    state = conf.parent
    pids = [int(p) for p in (state / "pids").read_text().split()]
    for pid in reversed(pids):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for pid in pids:
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    subprocess.run(["rm", "-rf", str(state)], check=False)


# ---- one run ------------------------------------------------------------------------------------


def _live(c: httpx.Client) -> set[str]:
    return {w["name"] for w in c.get("/api/health").json()["workers"]}


def _until(pred, timeout: float, what: str, every: float = 0.1):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(what)


def first_loss_time(db: Path, job_id: int) -> float | None:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return con.execute(
            "select min(time) from metric_points where job_id = ? and name = 'loss'", (job_id,)
        ).fetchone()[0]
    finally:
        con.close()


def one(c: httpx.Client, db: Path, body: dict[str, Any], launcher: str) -> dict[str, Any]:
    load0 = os.getloadavg()[0]
    job = c.post("/api/jobs", json=body)
    job.raise_for_status()
    jid = job.json()["id"]
    done = _until(
        lambda: (
            (j := c.get(f"/api/jobs/{jid}").json())["status"] in ("succeeded", "failed", "cancelled") and j
        ),
        300,
        f"job {jid} did not end",
        every=0.25,
    )
    if done["status"] != "succeeded":
        raise RuntimeError(f"job {jid} {done['status']}: {done.get('error') or done.get('wait_reason')}")
    worker = done["worker"] or ""
    if worker.startswith("slurm:") != (launcher == "slurm"):
        raise RuntimeError(f"job {jid} meant for {launcher} ran on {worker}")
    submit = _utc(done["created_at"])
    first = first_loss_time(db, jid)
    if first is None:
        raise RuntimeError(f"job {jid} stored no loss point")
    row: dict[str, Any] = {
        "launcher": launcher,
        "job_id": jid,
        "worker": worker,
        "submit_to_running_s": round(_utc(done["started_at"]) - submit, 3),
        "submit_to_first_step_s": round(first - submit, 3),
        "load_before": round(load0, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    if launcher == "slurm":
        events = c.get(f"/api/jobs/{jid}/logs").json()["items"]
        sub = next(
            (
                e["time"]
                for e in events
                if e["message"].startswith("slurm job") and " submitted" in e["message"]
            ),
            None,
        )
        started = next(
            (
                e["time"]
                for e in events
                if e["message"].startswith("slurm job") and " started on " in e["message"]
            ),
            None,
        )
        if sub is not None:
            row["submit_to_sbatch_s"] = round(sub - submit, 3)
        if sub is not None and started is not None:
            row["sbatch_to_agent_s"] = round(started - sub, 3)
        if started is not None:
            row["agent_to_first_step_s"] = round(first - started, 3)
    return row


def run(reps: int, steps: int, poll_s: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    prefix = f"sybench{secrets.token_hex(2)}"
    pool = {
        "name": "bench",
        "partition": "main",
        "nodes": 1,
        "slots_per_node": 2,
        "job_prefix": prefix,
        "time_limit_s": 600,
    }
    env = {
        "SHARDYARD_SLURM_POOLS": json.dumps([pool]),
        "SHARDYARD_SLURM_POLL_S": str(poll_s),
        "SHARDYARD_HEARTBEAT_S": "1",
        "SHARDYARD_WORKER_ALIVE_S": str(ALIVE_S),
    }
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, Stack(root=Path(tmp), workers=1, extra_env=env) as st:
        c = httpx.Client(
            base_url=st.base_url, timeout=30, headers={"Authorization": f"Bearer {st.admin_token}"}
        )
        sub = st._spawn("slurm-pool", [sys.executable, "-m", "workers.slurm_pool"])
        node = "slurm:bench:0"
        stopped = False
        try:
            _until(lambda: node in _live(c), 60, "the pool's node never beat")
            body = spec(steps)
            # one unmeasured run on each first: the page cache (torch, the data set) warm for both
            order = ["celery", "slurm"] + ["celery", "slurm"] * reps
            for i, launcher in enumerate(order):
                if launcher == "celery":
                    os.kill(sub.pid, signal.SIGSTOP)
                    stopped = True
                    _until(
                        lambda: node not in _live(c),
                        ALIVE_S + 10,
                        "the paused pool's node still live",
                        every=0.25,
                    )
                else:
                    os.kill(sub.pid, signal.SIGCONT)
                    stopped = False
                    _until(lambda: node in _live(c), 30, "the resumed pool's node not live", every=0.1)
                    time.sleep(2 * poll_s)  # its first polls after the pause done
                row = one(c, st.root / "shardyard.db", body, launcher)
                row["warmup"] = i < 2
                print(json.dumps(row), flush=True)
                runs.append(row)
        finally:
            if stopped:
                os.kill(sub.pid, signal.SIGCONT)
            ids = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True).stdout
            ours = [ln.split()[0] for ln in ids.splitlines() if ln.split()[1].startswith(prefix + "-")]
            if ours:
                subprocess.run(["scancel", *ours], check=False)
            c.close()
    return runs, {"pool": pool, "slurm_poll_s": poll_s, "heartbeat_s": 1, "worker_alive_s": ALIVE_S}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.slurm_start", description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--poll", type=float, default=1.0, help="SHARDYARD_SLURM_POLL_S (its default: 1.0)")
    args = ap.parse_args()
    own = not os.environ.get("SLURM_CONF")
    if own:
        conf = cluster_up()
        os.environ["SLURM_CONF"] = str(conf)
    else:
        conf = Path(os.environ["SLURM_CONF"])
    loads = [os.getloadavg()]
    try:
        runs, settings = run(args.reps, args.steps, args.poll)
    finally:
        loads.append(os.getloadavg())
        if own:
            cluster_down(conf)
    measured = [r for r in runs if not r["warmup"]]
    rows = []
    med: dict[str, float] = {}
    for launcher in ("celery", "slurm"):
        mine = [r for r in measured if r["launcher"] == launcher]
        med[launcher] = statistics.median(r["submit_to_first_step_s"] for r in mine)
        row = {
            "launcher": launcher,
            "runs": len(mine),
            "submit -> running s (median)": round(
                statistics.median(r["submit_to_running_s"] for r in mine), 2
            ),
            "submit -> first step s (median)": round(med[launcher], 2),
            "min": round(min(r["submit_to_first_step_s"] for r in mine), 2),
            "max": round(max(r["submit_to_first_step_s"] for r in mine), 2),
        }
        rows.append(row)
    ratio = med["slurm"] / med["celery"]
    split = {
        k: round(statistics.median(r[k] for r in measured if r["launcher"] == "slurm" and k in r), 2)
        for k in ("submit_to_sbatch_s", "sbatch_to_agent_s", "agent_to_first_step_s")
        if any(k in r for r in measured if r["launcher"] == "slurm")
    }
    load_runs = [r["load_before"] for r in measured] + [r["load_after"] for r in measured]
    title = (
        f"submit -> first step, same job, Slurm pool vs Celery worker: slurm/celery = {ratio:.2f}"
        f" (+{med['slurm'] - med['celery']:.2f} s); load average {min(load_runs):.1f}-{max(load_runs):.1f}"
        f" on {os.cpu_count()} cores"
    )
    print(table(rows, title=title))
    print("slurm, split (medians):", split)
    path = write_results(
        "slurm_start",
        {
            "command": "nice -n 10 python -m bench.slurm_start " + " ".join(sys.argv[1:]),
            "spec": spec(args.steps),
            "settings": settings,
            "rows": rows,
            "ratio_slurm_over_celery": round(ratio, 3),
            "extra_s": round(med["slurm"] - med["celery"], 3),
            "slurm_split_median_s": split,
            "load_average_start_end": loads,
            "load_average_runs": [min(load_runs), max(load_runs)],
            "runs": runs,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
