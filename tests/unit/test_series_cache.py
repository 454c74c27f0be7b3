"""api/series.py, the per-job series cache of GET /api/jobs/{id}/metrics, on both databases: every
read answers what the database holds (the points committed since the last read included), reads
only those new points, and reads everything again for a new attempt, a point out of step order or
an entry older than FULL_READ_S."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update

from api import series
from api.downsample import downsample
from db import ingest
from db import jobs as dbj
from db.connection import session_for
from db.ingest import _upsert_points
from db.models import Job

SPEC = {"model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8}, "train": {"steps": 9}}


def _points(
    job_id: int, steps: range, *, scale: float = 1.0, names: tuple[str, ...] = ("loss", "lr")
) -> list:
    return [
        {"job_id": job_id, "name": n, "step": st, "value": st * scale * (2 if n == "lr" else 1), "time": 0.0}
        for st in steps
        for n in names
    ]


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    series.clear()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The `after_id` of each database read the cache makes (0: a full read)."""
    seen: list[int] = []
    real = ingest.metric_rows

    def counted(session: Any, *, job_id: int, after_id: int = 0) -> list:
        seen.append(after_id)
        return real(session, job_id=job_id, after_id=after_id)

    monkeypatch.setattr(ingest, "metric_rows", counted)
    return seen


def _cached(url: str, job_id: int, **kw: Any) -> dict[str, tuple[list[int], list[float]]]:
    """What the route answers, through the cache, from a fresh request session."""
    with session_for(url) as s:
        job = dbj.get_job(s, job_id)
        args = {"names": None, "since_step": 0, "max_points": None, **kw}
        return series.job_series(s, database_url=url, job=job, **args)


def _truth(url: str, job_id: int) -> dict[str, tuple[list[int], list[float]]]:
    with session_for(url) as s:
        return ingest.metric_series(s, job_id=job_id)


def test_each_read_has_the_points_committed_before_it_and_reads_only_new_ones(
    db_url: str, reads: list[int]
) -> None:
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec=SPEC, world_size=1).id
        other = dbj.create_job(s, name="k", spec=SPEC, world_size=1).id
        _upsert_points(s, _points(job, range(1, 6)) + _points(other, range(1, 3), scale=9.0))
        s.commit()
    assert _cached(db_url, job) == _truth(db_url, job)
    assert reads == [0]
    for first in (6, 11, 16):
        with session_for(db_url) as s:
            _upsert_points(s, _points(job, range(first, first + 5)))
            s.commit()
        got = _cached(db_url, job)
        assert got == _truth(db_url, job)
        assert got["loss"][0][-1] == first + 4  # the new job state, on the next read
        assert reads[-1] > 0  # only what came after the last point held
    assert reads.count(0) == 1
    # another job has its own entry; a read with nothing new reads nothing twice
    assert _cached(db_url, other) == _truth(db_url, other)
    assert _cached(db_url, job) == _truth(db_url, job)


def test_names_first_step_and_downsampling_answer_as_from_the_database(db_url: str) -> None:
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec=SPEC, world_size=1).id
        _upsert_points(s, _points(job, range(1, 301)) + _points(job, range(1, 40), names=("val_loss",)))
        s.commit()
    full = _truth(db_url, job)
    assert _cached(db_url, job, names=["lr", "nope"]) == {"lr": full["lr"]}
    assert _cached(db_url, job, since_step=295, names=["loss"]) == {
        "loss": ([295, 296, 297, 298, 299, 300], [295.0, 296.0, 297.0, 298.0, 299.0, 300.0])
    }
    assert "val_loss" not in _cached(db_url, job, since_step=40)
    small = _cached(db_url, job, max_points=20)
    assert small == {n: downsample(*full[n], max_points=20) for n in full}
    assert len(small["loss"][0]) == 20 and small["loss"][0][0] == 1 and small["loss"][0][-1] == 300


def test_a_new_attempt_rewriting_steps_in_place_is_read_in_full(db_url: str, reads: list[int]) -> None:
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec=SPEC, world_size=1).id
        _upsert_points(s, _points(job, range(1, 11)))
        s.commit()
    assert _cached(db_url, job)["loss"][1][-1] == 10.0
    with session_for(db_url) as s:
        # the next attempt resumes from step 5: steps 6-10 are overwritten (same rows, same ids)
        s.execute(update(Job).where(Job.id == job).values(attempts=Job.attempts + 1))
        _upsert_points(s, _points(job, range(6, 11), scale=-1.0))
        s.commit()
    got = _cached(db_url, job)
    assert got == _truth(db_url, job)
    assert got["loss"][1][-1] == -10.0
    assert reads == [0, 0]


def test_a_point_out_of_step_order_and_an_old_entry_are_read_in_full(
    db_url: str, reads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec=SPEC, world_size=1).id
        _upsert_points(s, _points(job, range(5, 11)))
        s.commit()
    _cached(db_url, job)
    with session_for(db_url) as s:
        _upsert_points(s, _points(job, range(1, 3), names=("loss",)))  # new rows, earlier steps
        s.commit()
    got = _cached(db_url, job)
    assert got == _truth(db_url, job) and got["loss"][0][:3] == [1, 2, 5]
    assert reads == [0, reads[1], 0] and reads[1] > 0
    # an in-place rewrite in the same attempt is not a new row: the entry's age bounds how long
    # it can go unseen
    with session_for(db_url) as s:
        _upsert_points(s, [{"job_id": job, "name": "lr", "step": 7, "value": 70.0, "time": 1.0}])
        s.commit()
    monkeypatch.setattr(series, "FULL_READ_S", 0.0)
    assert _cached(db_url, job) == _truth(db_url, job)
    assert dict(zip(*_cached(db_url, job)["lr"], strict=True))[7] == 70.0


@pytest.fixture
def small_summaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 'long' series is 300 points here, summarized to 40."""
    monkeypatch.setattr(series, "SUMMARY_MIN_POINTS", 300)
    monkeypatch.setattr(series, "SUMMARY_POINTS", 40)


def test_a_long_series_is_summarized_once_and_a_later_first_read_starts_from_it(
    db_url: str, reads: list[int], small_summaries: None
) -> None:
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="long", spec=SPEC, world_size=1).id
        _upsert_points(s, _points(job, range(1, 401)) + _points(job, range(1, 21), names=("val_loss",)))
        s.commit()
    full = _truth(db_url, job)
    # the first read reads every point, answers exactly, and stores every series of the job
    assert _cached(db_url, job, max_points=10) == {n: downsample(*full[n], max_points=10) for n in full}
    assert reads == [0]
    with session_for(db_url) as s:
        stored = {r.name: r for r in ingest.metric_summaries(s, job_id=job, attempt=0)}
    assert set(stored) == {"loss", "lr", "val_loss"}
    assert (stored["loss"].points, len(stored["loss"].steps) // 8) == (400, 40)
    assert (stored["val_loss"].points, len(stored["val_loss"].steps) // 8) == (20, 20)  # short: whole
    # points after it; then another process's first read (the cache emptied) reads only those
    with session_for(db_url) as s:
        _upsert_points(s, _points(job, range(401, 411)))
        s.commit()
    series.clear()
    got = _cached(db_url, job, max_points=10)
    assert reads[1] > 0 and 0 not in reads[1:]  # no full read: the summary, then the new points
    # a short series is kept whole: answered as from every point
    assert got["val_loss"] == downsample(*full["val_loss"], max_points=10)
    loss = got["loss"]
    assert len(loss[0]) == 10 and loss[0][0] == 1 and loss[0][-1] == 410
    assert all(v == float(st) for st, v in zip(*loss, strict=True))  # real points, none made up
    # an answer finer than the summary keeps reads every point
    assert _cached(db_url, job) == _truth(db_url, job)


def test_a_summary_stands_for_its_attempt_only_and_goes_with_its_job(
    db_url: str, reads: list[int], small_summaries: None
) -> None:
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="long", spec=SPEC, world_size=1).id
        _upsert_points(s, _points(job, range(1, 301)))
        s.commit()
    _cached(db_url, job, max_points=10)
    with session_for(db_url) as s:
        # the next attempt rewrites steps 100-300 in place: the summary of attempt 0 is ignored
        s.execute(update(Job).where(Job.id == job).values(attempts=1))
        _upsert_points(s, _points(job, range(100, 301), scale=-1.0))
        s.commit()
    series.clear()
    got = _cached(db_url, job, max_points=10)
    assert reads == [0, 0] and got["loss"][1][-1] == -300.0
    with session_for(db_url) as s:
        assert [r.attempt for r in ingest.metric_summaries(s, job_id=job, attempt=1)] == [1, 1]
        s.execute(update(Job).where(Job.id == job).values(status="succeeded"))
        s.commit()
        from db.retention import delete_job

        delete_job(s, job_id=job)
        assert ingest.metric_summaries(s, job_id=job, attempt=1) == []
