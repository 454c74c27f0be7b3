"""A trial's API data carries its job's start and end (TrialPublic.started_at / finished_at), read
in the trials' own SELECT: the batch page orders its best-so-far curve by them with no request per
trial, and the API answers a batch with no query per trial."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import event, update

from api.convert import selection_public
from db import jobs as dbj
from db import selections as dbs
from db.connection import session_for
from db.models import Job, JobStatus


def test_trials_carry_their_jobs_times_without_a_query_each(db_url: str) -> None:
    with session_for(db_url) as s:
        sel = dbs.create_selection(s, name="b", request={}, metric="val_loss", mode="min", scheduler="x")
        spec = {"train": {"steps": 4}}
        plans = [(i, {}, spec) for i in range(6)]
        trials = dbs.add_trials(s, selection_id=sel.id, plans=plans, queue="cpu")
        dbs.claim_trials(s, trial_ids=[t.id for t in trials[:4]], owner="o", worker="w", lease_s=30)
        # trials 0 and 2 ended, 2 first
        now = dbj.db_now(s)
        for t, ended_s in ((trials[2], 1), (trials[0], 5)):
            s.execute(
                update(Job)
                .where(Job.id == t.job_id)
                .values(
                    status=JobStatus.succeeded,
                    finished_at=now.replace(tzinfo=None) + timedelta(seconds=ended_s),
                )
            )
        s.commit()
        sel_id = sel.id
    with session_for(db_url) as s:
        statements: list[str] = []
        event.listen(s.get_bind(), "before_cursor_execute", lambda *a: statements.append(a[2]))
        body = selection_public(dbs.get_selection(s, sel_id))
    by_index = {t.index: t for t in body.trials}
    assert by_index[2].finished_at is not None and by_index[0].finished_at is not None
    assert by_index[2].finished_at < by_index[0].finished_at
    assert by_index[2].finished_at.tzinfo is not None
    assert all(by_index[i].started_at is not None for i in range(4))
    assert by_index[5].started_at is None and by_index[5].finished_at is None
    assert by_index[1].finished_at is None  # still running
    # the selection, its trials (with their jobs' times) and its owner: never one per trial
    assert len(statements) <= 4, statements
