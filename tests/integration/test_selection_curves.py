"""GET /api/selections/{id}/curves: one metric of every trial of a batch in one answer (the batch
page asked once per trial: a thousand requests for 1,000 trials), on a real API process, with the
query on SQLite and Postgres."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from api.stack import Stack
from bench.scale_seed import Sizes, _seed_selection
from db import ingest as dbi
from db.connection import session_for
from db.jobs import create_job
from db.models import MetricPoint, Trial
from db.users import create_user
from tests.conftest import StackHandle, running

pytestmark = pytest.mark.integration


def _points(url: str, rows: list[tuple[int, int, str, float]]) -> None:
    with session_for(url) as s:
        s.add_all(MetricPoint(job_id=j, step=st, name=n, value=v, time=0.0) for j, st, n, v in rows)
        s.commit()


def test_series_of_jobs_reads_one_metric_per_job_in_step_order(db_url: str) -> None:
    with session_for(db_url) as s:
        jobs = [create_job(s, name=f"j{i}", spec={"train": {"steps": 9}}).id for i in range(3)]
    a, b, c = jobs
    # stored out of step order, with another metric between, and a job without the metric
    _points(db_url, [(a, 20, "val_loss", 2.0), (a, 10, "val_loss", 3.0), (a, 10, "loss", 9.0)])
    _points(db_url, [(b, 5, "val_loss", 1.5), (c, 5, "loss", 4.0)])
    with session_for(db_url) as s:
        got = dbi.series_of_jobs(s, job_ids=jobs, name="val_loss")
        assert got == {a: ([10, 20], [3.0, 2.0]), b: ([5], [1.5])}
        # more ids than one statement takes: read in chunks, the answer the same
        assert dbi.series_of_jobs(s, job_ids=[*range(10_000, 12_500), a], name="val_loss") == {
            a: ([10, 20], [3.0, 2.0])
        }


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    with running(Stack(root=tmp_path_factory.mktemp("curves"), workers=0)) as handle:
        yield handle


def test_a_batchs_curves_come_in_one_answer_downsampled(api: StackHandle) -> None:
    url = api.stack.database_url
    with session_for(url) as s:
        owner = create_user(s, name="curves-owner").id
    sizes = Sizes(
        jobs=100, points=10_000, big_job_points=0, trials=6, trial_steps=50, queued=1, fleet_fill=1, running=1
    )
    sid, job_ids = _seed_selection(url, sizes=sizes, owner=owner, rng=random.Random(0))
    # trial 0: 300 val_loss points; trial 1: 3; the others none
    _points(url, [(job_ids[0], st, "val_loss", 1.0 / st) for st in range(1, 301)])
    _points(url, [(job_ids[1], st, "val_loss", float(st)) for st in (1, 2, 3)])
    _points(url, [(job_ids[1], 1, "train_loss", 7.0)])
    r = api.client.get(f"/api/selections/{sid}/curves", params={"max_points": 50})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["name"] == "val_loss" and set(body["curves"]) == {str(job_ids[0]), str(job_ids[1])}
    long, short = body["curves"][str(job_ids[0])], body["curves"][str(job_ids[1])]
    assert len(long["steps"]) == 50 and long["steps"][0] == 1 and long["steps"][-1] == 300
    assert all(v == 1.0 / s for s, v in zip(long["steps"], long["values"], strict=True))
    assert short == {"steps": [1, 2, 3], "values": [1.0, 2.0, 3.0]}
    # another metric by name; a trial's job is the key the leaderboard names
    other = api.client.get(f"/api/selections/{sid}/curves", params={"name": "train_loss"}).json()
    assert other["curves"] == {str(job_ids[1]): {"steps": [1], "values": [7.0]}}
    with session_for(url) as s:
        assert {t.job_id for t in s.query(Trial).filter(Trial.selection_id == sid)} == set(job_ids)
    assert api.client.get("/api/selections/999999/curves").status_code == 404
