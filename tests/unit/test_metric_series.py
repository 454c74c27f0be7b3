"""db/ingest.py metric_series on both databases: one series per name, in step order, filtered by
name and first step, whatever order the points were written in."""

from __future__ import annotations

from db import ingest as dbi
from db import jobs as dbj
from db.connection import session_for
from db.ingest import _upsert_points

SPEC = {"model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8}, "train": {"steps": 9}}


def test_series_grouped_by_name_in_step_order(db_url: str) -> None:
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec=SPEC, world_size=1).id
        other = dbj.create_job(s, name="k", spec=SPEC, world_size=1).id
        rows = [
            {"job_id": job, "name": n, "step": st, "value": float(st) * (2 if n == "lr" else 1), "time": 0.0}
            for st in (5, 1, 3, 2, 4)
            for n in ("loss", "lr")
        ]
        rows.append({"job_id": other, "name": "loss", "step": 1, "value": 99.0, "time": 0.0})
        _upsert_points(s, rows)
        # a re-reported step replaces its value (insert-or-update), it is not a second point
        _upsert_points(s, [{"job_id": job, "name": "loss", "step": 3, "value": 30.0, "time": 1.0}])
        s.commit()
        assert dbi.metric_series(s, job_id=job) == {
            "loss": ([1, 2, 3, 4, 5], [1.0, 2.0, 30.0, 4.0, 5.0]),
            "lr": ([1, 2, 3, 4, 5], [2.0, 4.0, 6.0, 8.0, 10.0]),
        }
        assert dbi.metric_series(s, job_id=job, names=["lr"], since_step=4) == {"lr": ([4, 5], [8.0, 10.0])}
        assert dbi.metric_series(s, job_id=job, names=["nope"]) == {}
