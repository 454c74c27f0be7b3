"""The divergence rule (jobrules/divergence.py) and its application at a job's end on the real
SQLite and PostgreSQL (db/jobs.py finish_job): judged on the whole loss series, every attempt's,
so a resumed job is judged on its run."""

from __future__ import annotations

import math
import time

import pytest
from pydantic import ValidationError

from db import jobs as dbj
from db.connection import session_for
from db.ingest import JobLines, apply_lines
from db.models import JobStatus
from jobrules.divergence import divergence, judge, tail_size
from jobrules.spec import JobSpec


def test_the_rule_compares_the_mean_of_the_last_tenth_with_the_first_loss() -> None:
    calm = [(s, 4.0 - s * 0.01) for s in range(1, 101)]
    assert divergence(calm, factor=10) is None
    # one spike at the end is smoothed away by the mean of the last 10 points
    spiky = [*calm[:-1], (100, 200.0)]
    assert tail_size(len(spiky)) == 10
    assert divergence(spiky, factor=10) is None
    blown = [(1, 4.0), *((s, 48_310.0) for s in range(2, 40))]
    why = divergence(blown, factor=10)
    assert why is not None and "48,310" in why and "12,077.5x" in why and "step 1" in why, why
    assert divergence([(1, 4.0), (2, math.inf)], factor=10) is not None
    # no ratio to speak of: too few points, a first loss that is not positive
    assert divergence([(1, 4.0)], factor=10) is None
    assert divergence([(1, -1.0), (2, 50.0)], factor=10) is None
    assert divergence([(1, 4.0), (2, 41.0)], factor=10) is not None
    assert divergence([(1, 4.0), (2, 39.0)], factor=10) is None


def test_the_spec_options_are_checked() -> None:
    train = JobSpec.model_validate({"train": {"fail_on_divergence": True, "divergence_factor": 3}}).train
    assert train.fail_on_divergence and train.divergence_factor == 3
    for bad in ({"divergence_factor": 1.0}, {"divergence_factor": "x"}, {"fail_on_divergence": "maybe"}):
        with pytest.raises(ValidationError):
            JobSpec.model_validate({"train": bad})
    # a spec stored before the options existed has the defaults
    assert judge({"train": {}}, [(1, 1.0), (2, 11.0)]) == (judge({}, [(1, 1.0), (2, 11.0)]))


def _run(url: str, *, spec: dict, losses: list[tuple[int, float]], attempt: dbj.Attempt | None = None):  # noqa: ANN202
    with session_for(url) as s:
        if attempt is None:
            job_id = dbj.create_job(s, name="d", spec=spec, steps=len(losses)).id
        else:
            job_id = attempt.job_id
        got = dbj.claim_job(s, job_id=job_id, owner=f"o{time.monotonic_ns()}", worker="w", lease_s=30)
        assert got is not None
        lines = JobLines(metrics=[(i, st, "loss", v, time.time()) for i, (st, v) in enumerate(losses)])
        assert apply_lines(s, attempt=got, lines=lines, lease_s=30, now=dbj.db_now(s)) is not None
        s.commit()
    return got


def test_a_resumed_job_is_judged_on_its_whole_run(db_url: str) -> None:
    spec = {"train": {"steps": 20}}
    first = _run(db_url, spec=spec, losses=[(s, 4.0) for s in range(1, 11)])
    with session_for(db_url) as s:  # the worker was lost after step 10
        assert dbj.release_job(s, attempt=first, reason="shut down")
    # the second attempt alone starts high and stays there: not a divergence of its own, but
    # the run's loss went from 4 to 50
    second = _run(db_url, spec=spec, losses=[(s, 50.0) for s in range(11, 21)], attempt=first)
    with session_for(db_url) as s:
        assert dbj.finish_job(s, attempt=second, status=JobStatus.succeeded, judge=judge) is not None
        job = dbj.get_job(s, first.job_id)
        assert job.status == JobStatus.succeeded and job.error is None
        assert job.divergence is not None and "12.5x its first value 4 (step 1)" in job.divergence


def test_fail_on_divergence_fails_the_job_and_a_calm_run_is_not_flagged(db_url: str) -> None:
    spec = {"train": {"steps": 4, "fail_on_divergence": True, "divergence_factor": 2}}
    blown = _run(db_url, spec=spec, losses=[(1, 4.0), (2, 9.0), (3, 9.0), (4, 9.0)])
    calm = _run(db_url, spec=spec, losses=[(1, 4.0), (2, 3.0), (3, 2.0), (4, 7.9)])
    with session_for(db_url) as s:
        for a in (blown, calm):
            assert dbj.finish_job(s, attempt=a, status=JobStatus.succeeded, judge=judge) is not None
        failed, ok = dbj.get_job(s, blown.job_id), dbj.get_job(s, calm.job_id)
        assert failed.status == JobStatus.failed and failed.divergence is not None
        assert failed.error is not None and failed.error.startswith("diverged: the training loss ended at 9")
        assert failed.error.endswith("train.fail_on_divergence is set"), failed.error
        assert ok.status == JobStatus.succeeded and ok.divergence is None and ok.error is None
