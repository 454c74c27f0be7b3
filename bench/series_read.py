"""What GET /api/jobs/{id}/metrics costs for a long job, without HTTP: a job with `--steps` points
of `loss` and of `lr` in a SQLite file; each round stores 100 new steps (what a relay batch adds),
then the series are read and downsampled to 200 points, the way the route did before the per-job
series cache (every point read and turned into arrays) and through the cache (api/series.py: the
new points only).

    python -m bench.series_read [--steps 60000] [--rounds 20]

Writes bench/results/series_read.json naming the machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from api import series
from api.downsample import downsample
from bench.common import table, write_results
from db import jobs as dbj
from db.connection import session_for
from db.jobs import _upsert_points
from db.migrate import upgrade

SPEC = {"model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8}, "train": {"steps": 9}}
MAX_POINTS = 200


def _store(url: str, job_id: int, first: int, last: int) -> None:
    rows = [
        {"job_id": job_id, "name": n, "step": st, "value": 1.0 / st, "time": 0.0}
        for st in range(first, last + 1)
        for n in ("loss", "lr")
    ]
    with session_for(url) as s:
        _upsert_points(s, rows)
        s.commit()


def _before(url: str, job_id: int) -> None:
    with session_for(url) as s:
        dbj.get_job(s, job_id)
        raw = dbj.metric_series(s, job_id=job_id)
        for steps, values in raw.values():
            downsample(steps, values, max_points=MAX_POINTS)


def _after(url: str, job_id: int) -> None:
    with session_for(url) as s:
        job = dbj.get_job(s, job_id)
        series.job_series(s, database_url=url, job=job, names=None, since_step=0, max_points=MAX_POINTS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60_000)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        upgrade(url)
        with session_for(url) as s:
            job_id = dbj.create_job(s, name="long", spec=SPEC, world_size=1).id
        for first in range(1, args.steps + 1, 10_000):
            _store(url, job_id, first, min(args.steps, first + 9_999))
        times: dict[str, list[float]] = {"before": [], "after": []}
        t0 = time.perf_counter()
        _after(url, job_id)  # the first read of a job is a full read
        first_read = (time.perf_counter() - t0) * 1e3
        last = args.steps
        for _ in range(args.rounds):
            _store(url, job_id, last + 1, last + 100)
            last += 100
            for how, read in (("before", _before), ("after", _after)):
                t0 = time.perf_counter()
                read(url, job_id)
                times[how].append((time.perf_counter() - t0) * 1e3)
    rows = [
        {
            "read": how,
            "median ms": statistics.median(xs),
            "max ms": max(xs),
        }
        for how, xs in times.items()
    ]
    rows.append({"read": "after, first read of the job", "median ms": first_read, "max ms": first_read})
    print(table(rows, title=f"one job, 2 series of {args.steps}+ points, {MAX_POINTS} points each answered"))
    payload = {
        "steps": args.steps,
        "series": 2,
        "max_points": MAX_POINTS,
        "rounds": args.rounds,
        "first_read_ms": first_read,
        "before_ms": times["before"],
        "after_ms": times["after"],
    }
    print(f"wrote {write_results('series_read', payload)}")


if __name__ == "__main__":
    main()
