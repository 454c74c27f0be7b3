"""Where a REST selection batch's wall goes: a timeline of bench.peer's REST FIFO batch.

    python -m bench.rest_timeline [--reps 3] [--steps 100] [--mode fifo] [--out rest_timeline]

Starts the same warm embedded stack as `python -m bench.peer` (one worker, warm trainer, SQLite),
runs its warm-up batch, then submits the peer batch (8 trials, 2 CPU devices) `--reps` times, one
after the other. While a batch runs it reads the group's reservation from the database every
20 ms (a reservation row is deleted when its group ends). Once the batch has ended it reads every
time the system already records, all on the server's clock (Unix seconds; the database's
timestamps and the trainer's line times):

- submit: the batch row's `created_at` (the API's commit of the POST).
- placed / sent / claimed: the group's reservation (`created_at`, `sent_at`, `claimed_at`): the
  scheduler's tick that placed it, the Celery message, the worker task's claim.
- task / launch / exited / relay closed: the worker's log line at the group's end
  (workers/selection.py GROUP_MARKS): its task began, the executor about to start, its process
  ended, every line of it in the database.
- main / prepare / built / devices / executor ended / summary: the executor's own phases (its
  batch_result's `marks`: the module began, building the trials on the host, built, the device
  processes forked, every device done, the result line written).
- each trial's first step (its first `loss` point, the trainer's time), its last metric point (its
  end in the executor) and its job's `finished_at` (the relay's commit of its end).
- ended: the batch row's `finished_at` (the wall bench.peer reports is finished_at - created_at).

Prints each repetition's timeline as offsets from the submit, and the median of each latency:
placement, dispatch (sent to claimed), start (claimed to the executor's first line), host build,
device fork, first step, tail (last trial's end in the executor to the batch's end), and the
packing (how long one device was idle while the other trained the batch's last trials).
Writes bench/results/<out>.json with the machine and the load average.

    python -m bench.rest_timeline --gaps [--reps 3] [--steps 100] [--mode fifo] [--out rest_gaps]

The executor alone on the same batch (in this process, device processes, the trace of every
task), with the next order sent ahead (`ExecutorConfig.send_ahead`, the default) and without,
interleaved: per device the gaps between one task's end and the next one's start (the dispatch
round trip, evaluations included), their median, and the devices' busy share of the run. Each
run also records every device's tasks as runs of one trial (`segments`); with `--mode asha` it
prints them, to show where a device idled and which trial trained alone at the end
(bench/results/rest_gaps_asha.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_results
from bench.peer import rest_batch, start_stack


def _utc(s: str | None) -> float | None:
    """A SQLite DateTime column (naive, UTC) as Unix seconds."""
    if s is None:
        return None
    d = datetime.fromisoformat(s)
    return (d if d.tzinfo else d.replace(tzinfo=UTC)).timestamp()


class ReservationWatch:
    """Reads the reservations table every `every_s` until stopped; keeps each row's latest times."""

    def __init__(self, db: Path, every_s: float = 0.02) -> None:
        self.db, self.every_s = db, every_s
        self.rows: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5)
        try:
            while not self._stop.is_set():
                try:
                    for rid, created, sent, claimed, trials in con.execute(
                        "select id, created_at, sent_at, claimed_at, trial_ids from reservations"
                    ):
                        if trials is None:
                            continue
                        r = self.rows.setdefault(rid, {})
                        r.update(
                            {
                                k: v
                                for k, v in (("placed", created), ("sent", sent), ("claimed", claimed))
                                if v is not None
                            }
                        )
                except sqlite3.OperationalError:  # locked by a writer: read again next time
                    pass
                self._stop.wait(self.every_s)
        finally:
            con.close()

    def __enter__(self) -> ReservationWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timeline(db: Path, selection_id: int, watch: ReservationWatch, stack_root: Path) -> dict[str, Any]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        created, finished = con.execute(
            "select created_at, finished_at from selections where id = ?", (selection_id,)
        ).fetchone()
        t0 = _utc(created)
        trials = con.execute(
            "select t.`index`, t.job_id, j.started_at, j.finished_at, t.result from trials t"
            " join jobs j on j.id = t.job_id where t.selection_id = ? order by t.`index`",
            (selection_id,),
        ).fetchall()
        per: dict[int, dict[str, float | None]] = {}
        busy = 0.0
        for index, job_id, started, ended, result in trials:
            busy += float(json.loads(result or "{}").get("compute_s") or 0.0)
            first = con.execute(
                "select min(time) from metric_points where job_id = ? and name = 'loss'", (job_id,)
            ).fetchone()[0]
            last = con.execute("select max(time) from metric_points where job_id = ?", (job_id,)).fetchone()[
                0
            ]
            per[index] = {
                "claimed": _utc(started),
                "first_step": first,
                "last_point": last,
                "committed": _utc(ended),
            }
    finally:
        con.close()
    res = next(iter(watch.rows.values()), {})
    worker = _worker_marks(stack_root, selection_id)
    executor = worker.get("executor", {})
    marks: dict[str, float | None] = {
        "submit": t0,
        "placed": _utc(res.get("placed")),
        "sent": _utc(res.get("sent")),
        "task": worker.get("task"),
        "claimed": _utc(res.get("claimed")) or worker.get("claimed"),
        "launch": worker.get("launch"),
        "main": executor.get("main"),
        "prepare": executor.get("prepare"),
        "built": executor.get("built"),
        "devices": executor.get("devices"),
        "first step (any trial)": min(p["first_step"] for p in per.values() if p["first_step"]),
        "last trial ends (executor)": max(p["last_point"] for p in per.values() if p["last_point"]),
        "executor ended": executor.get("ended"),
        "summary": executor.get("summary"),
        "exited": worker.get("exited"),
        "relay closed": worker.get("relay_closed"),
        "last trial committed": max(p["committed"] for p in per.values() if p["committed"]),
        "ended": _utc(finished),
    }
    ordered = dict(sorted(((k, v) for k, v in marks.items() if v is not None), key=lambda kv: kv[1]))
    ends = sorted(p["last_point"] for p in per.values() if p["last_point"])
    lat = {
        "placement (submit to placed)": _d(marks, "submit", "placed"),
        "dispatch (placed to task)": _d(marks, "placed", "task"),
        "task to launch": _d(marks, "task", "launch"),
        "launch to main": _d(marks, "launch", "main"),
        "main to prepare": _d(marks, "main", "prepare"),
        "host build": _d(marks, "prepare", "built"),
        "device fork": _d(marks, "built", "devices"),
        "devices to first step": _d(marks, "devices", "first step (any trial)"),
        "submit to first step": _d(marks, "submit", "first step (any trial)"),
        "last two trial ends apart": ends[-1] - ends[-2] if len(ends) > 1 else None,
        "last end to executor ended": _d(marks, "last trial ends (executor)", "executor ended"),
        "executor ended to exited": _d(marks, "executor ended", "exited"),
        "exited to relay closed": _d(marks, "exited", "relay closed"),
        "relay closed to batch end": _d(marks, "relay closed", "ended"),
        "last end to batch end (tail)": _d(marks, "last trial ends (executor)", "ended"),
        "wall (finished - created)": _d(marks, "submit", "ended"),
    }
    # the trials' own compute (tasks and evaluations, the executor's results) over what the two
    # devices had from the first step's end to the last trial's end (times every checkout
    # records): the rest is dispatch, waiting and the first steps' warm-up
    span = _d(marks, "first step (any trial)", "last trial ends (executor)")
    lat["device busy share"] = busy / (2 * span) if span else None
    return {
        "selection": selection_id,
        "marks_s": {k: v - t0 for k, v in ordered.items()},
        "latencies_s": lat,
        "trials_s": {
            i: {k: (v - t0 if v is not None else None) for k, v in p.items()} for i, p in per.items()
        },
    }


def _d(marks: dict[str, float | None], a: str, b: str) -> float | None:
    x, y = marks.get(a), marks.get(b)
    return None if x is None or y is None else y - x


def _worker_marks(stack_root: Path, selection_id: int) -> dict[str, float]:
    """The worker's phases of the group (workers/selection.py GROUP_MARKS, in the worker's log)."""
    try:
        from workers.selection import GROUP_MARKS
    except ImportError:  # a checkout from before the marks (its times come from the database only)
        return {}
    head = f"selection {selection_id} group-0: {GROUP_MARKS} "
    found: dict[str, float] = {}
    for path in stack_root.glob("worker*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if head in line:
                found = json.loads(line.split(head, 1)[1])
    return found


def device_segments(tasks: list[Any], t0: float) -> list[dict[str, Any]]:
    """One device's `tasks` (in start order) as runs of one trial's consecutive tasks (less than
    50 ms apart) merged: the trial, how many tasks, and the span in seconds from `t0`."""
    segs: list[dict[str, Any]] = []
    for x in tasks:
        if segs and segs[-1]["trial"] == x.trial and x.start - t0 - segs[-1]["end_s"] < 0.05:
            segs[-1].update(end_s=x.end - t0, tasks=segs[-1]["tasks"] + 1)
        else:
            segs.append({"trial": x.trial, "tasks": 1, "start_s": x.start - t0, "end_s": x.end - t0})
    return segs


def run_gaps(steps: int, *, send_ahead: bool, mode: str = "fifo") -> dict[str, Any]:
    """The peer batch through the executor in this process; the devices' gaps between tasks, and
    each device's runs of one trial's tasks (where a device idled, and what ran alone)."""
    import torch

    from bench.peer import batch_doc, trials
    from trainer.config import load_job
    from trainer.protocol import NullSink
    from trainer.selection.executor import Executor, TrialEntry
    from trainer.selection.job import parse_batch

    spec = parse_batch(batch_doc(trials(steps), mode))
    spec.executor.send_ahead = send_ahead
    entries = [TrialEntry(index=t.index, job=load_job(t.spec), sink=NullSink()) for t in spec.trials]
    ex = Executor(entries, devices=[torch.device("cpu")] * 2, cfg=spec.executor)
    t0 = time.perf_counter()
    res = ex.run()
    wall = time.perf_counter() - t0
    gaps, busy, spans, segments = [], 0.0, [], []
    t0_trace = min(x.start for x in ex.trace)
    for d in range(2):
        sl = sorted((x for x in ex.trace if x.device == d), key=lambda x: x.start)
        gaps += [b.start - a.end for a, b in zip(sl, sl[1:], strict=False)]
        busy += sum(x.end - x.start for x in sl)
        spans.append(sl[-1].end - sl[0].start)
        segments.append(device_segments(sl, t0_trace))
    return {
        "send_ahead": send_ahead,
        "mode": mode,
        "wall_s": wall,
        "segments": segments,
        "tasks": len(ex.trace),
        "orders": sum(r.orders for r in ex.runs.values()),
        "orders_ahead": ex.orders_ahead,
        "gap_median_ms": 1e3 * statistics.median(gaps),
        "gaps_s": sum(gaps),
        "busy_share": busy / sum(spans),
        "val_loss": {i: r["val_loss"] for i, r in res.items()},
    }


def gaps_main(args: argparse.Namespace) -> None:
    runs = []
    for rep in range(args.reps):
        for ahead in (False, True):
            before = os.getloadavg()[0]
            r = run_gaps(args.steps, send_ahead=ahead, mode=args.mode)
            r.update(rep=rep, load_before=before, load_after=os.getloadavg()[0])
            runs.append(r)
            print(
                f"rep {rep} send_ahead={ahead!s:5}: wall {r['wall_s']:6.2f} s, {r['tasks']} tasks in "
                f"{r['orders']} orders ({r['orders_ahead']} ahead), gap median {r['gap_median_ms']:.2f} ms, "
                f"gaps {r['gaps_s']:.2f} s, busy {r['busy_share']:.3f}, load {before:.1f}->{r['load_after']:.1f}",
                flush=True,
            )
            if args.mode == "asha":  # who trained where, and what ran alone at the end
                for d, segs in enumerate(r["segments"]):
                    tail = [g for g in segs if g["tasks"] > 1]
                    last = segs[-1]
                    print(
                        f"  device {d}: {len(segs)} runs, idle after {last['end_s']:.2f} s; runs of more "
                        "than one task: "
                        + ", ".join(
                            f"trial {g['trial']} x{g['tasks']} {g['start_s']:.2f}-{g['end_s']:.2f} s"
                            for g in tail
                        )
                    )
    assert len({json.dumps(r["val_loss"], sort_keys=True) for r in runs}) == 1, "the runs' numbers differ"
    med = {
        str(ahead): {
            k: statistics.median(r[k] for r in runs if r["send_ahead"] is ahead)
            for k in ("wall_s", "gap_median_ms", "gaps_s", "busy_share")
        }
        for ahead in (False, True)
    }
    print(f"medians: {json.dumps(med)}; every run the same val_loss of every trial")
    loads = [x for r in runs for x in (r["load_before"], r["load_after"])]
    path = write_results(
        args.out,
        {
            "steps": args.steps,
            "runs": runs,
            "medians": med,
            "load_average_1min": {"min": min(loads), "max": max(loads), "median": statistics.median(loads)},
        },
    )
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.rest_timeline", description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--mode", choices=["fifo", "asha"], default="fifo")
    ap.add_argument(
        "--out",
        default=None,
        help="rest_timeline, or with --gaps rest_gaps (rest_gaps_asha with --mode asha) (the default is the one current result, which is committed; another name is a scratch run for a comparison, not to be committed)",
    )
    ap.add_argument("--gaps", action="store_true", help="the executor alone, orders sent ahead or not")
    ap.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds between one batch's end (the warm-up's too) and the next submit (0: back to back, so each batch "
        "meets the spare sandboxed trainer the last one's end started, still importing; about 10: "
        "a worker that was idle a while, its spare ready)",
    )
    args = ap.parse_args()
    if args.gaps:
        args.out = args.out or ("rest_gaps" if args.mode == "fifo" else "rest_gaps_asha")
        gaps_main(args)
        return
    args.out = args.out or "rest_timeline"
    reps = []
    with tempfile.TemporaryDirectory(prefix="bench-restlat-") as tmpdir:
        tmp = Path(tmpdir)
        stack, client = start_stack(tmp)
        db = tmp / "stack" / "shardyard.db"
        try:
            for rep in range(args.reps):
                if args.pause:
                    time.sleep(args.pause)
                before = os.getloadavg()[0]
                with ReservationWatch(db) as watch:
                    sid = _run_batch(client, args.steps, args.mode)
                tl = timeline(db, sid, watch, tmp / "stack")
                tl.update(rep=rep, load_before=before, load_after=os.getloadavg()[0])
                reps.append(tl)
                print(f"\nrep {rep}: selection {sid}, load {before:.2f}->{tl['load_after']:.2f}")
                for k, v in tl["marks_s"].items():
                    print(f"  {v:8.3f} s  {k}")
                for k, v in tl["latencies_s"].items():
                    if v is not None:
                        print(f"  {k:32s} {v:7.3f}{'' if k.endswith('share') else ' s'}")
        finally:
            client.close()
            stack.stop()
    names = list(reps[0]["latencies_s"])
    med = {
        k: statistics.median(vs)
        for k in names
        if (vs := [r["latencies_s"][k] for r in reps if r["latencies_s"][k] is not None])
    }
    print(f"\nmedians over {len(reps)} batches:")
    for k, v in med.items():
        print(f"  {k:32s} {v:7.3f}{'' if k.endswith('share') else ' s'}")
    loads = [x for r in reps for x in (r["load_before"], r["load_after"])]
    path = write_results(
        args.out,
        {
            "steps": args.steps,
            "mode": args.mode,
            "reps": reps,
            "latency_medians_s": med,
            "load_average_1min": {"min": min(loads), "max": max(loads), "median": statistics.median(loads)},
        },
    )
    print(f"wrote {path}")


def _run_batch(client: httpx.Client, steps: int, mode: str) -> int:
    r = client.post("/api/selections", json=rest_batch(steps, mode))
    r.raise_for_status()
    sid = r.json()["id"]
    while client.get(f"/api/selections/{sid}").json()["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.5)
    return sid


if __name__ == "__main__":
    main()
