"""A sampler batch's next trial, asked by a running group (workers/search.py ask_due)
on a real database (SQLite and Postgres, migrated by Alembic): asked only once the trials its ask
is told have ended (trial k-parallel here: every trial costs the same), the batch's last trial
with the one before it, added to that group already claimed (the scheduler never sees it queued),
exactly the trial the seeded replay asks; `grow` leaves a batch alone while a group of it runs."""

from __future__ import annotations

from sqlalchemy import update

from core.search import request_plan
from core.settings import Settings
from db import scheduling as dbs
from db import selections as dbsel
from db.connection import session_for
from db.models import Job, JobStatus, Reservation, Trial
from workers.search import ask_due, grow

BASE = {
    "name": "tpe",
    "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 1, "seq_len": 8, "vocab_size": 64},
    "train": {"steps": 2, "batch_size": 2},
}
SPACE = {"train.lr": {"low": 1e-4, "high": 1e-1, "log": True}}
# one start-up trial: trial 2 is the model's, asked once trial 0 has ended, and trial 3, the
# batch's last, is asked with it (core/search.py TAIL)
REQ = {
    "method": "tpe",
    "space": SPACE,
    "base": BASE,
    "trials": 4,
    "parallel": 2,
    "devices": 2,
    "seed": 3,
    "startup_trials": 1,
}


def replay(values: list[float]) -> list[dict]:
    return [a.params for a in request_plan(REQ, values=values).trials]


def running_group(url: str) -> tuple[int, int, list[int]]:
    """A TPE batch's first two trials, claimed by process `p1` as one group on worker `w`."""
    with session_for(url) as s:
        sel = dbsel.create_selection(
            s, name="tpe", request=REQ, metric="val_loss", mode="min", scheduler="shard-lrtf"
        )
        plans = [
            (i, p, {**BASE, "train": {**BASE["train"], "lr": p["train.lr"]}})
            for i, p in enumerate(replay([]))
        ]
        trials = dbsel.add_trials(s, selection_id=sel.id, plans=plans, queue="cpu")
        ids = [t.id for t in trials]
        res = Reservation(job_id=trials[0].job_id, worker="w", slots=2, trial_ids=ids)
        s.add(res)
        s.commit()
        assert (
            len(
                dbsel.claim_trials(
                    s, trial_ids=ids, owner="p1", worker="w", lease_s=60, reservation_id=res.id
                )
            )
            == 2
        )
        return sel.id, res.id, ids


def end(url: str, trial_id: int, value: float) -> None:
    with session_for(url) as s:
        s.execute(update(Trial).where(Trial.id == trial_id).values(status="succeeded", best_metric=value))
        s.commit()


def test_a_running_group_asks_its_next_trial_once_it_is_due(db_url: str) -> None:
    settings = Settings(database_url=db_url)
    sel, res, ids = running_group(db_url)

    def ask(owner: str = "p1"):  # noqa: ANN202
        got = ask_due(settings, selection_id=sel, reservation_id=res, worker="w", owner=owner, limit=1)
        return got[0] if got else None

    assert ask() is None  # trial 2 waits for trial 0
    end(db_url, ids[0], 2.5)
    assert grow(settings, selection_id=sel) == []  # a group of the batch runs: it asks for itself
    assert ask(owner="p2") is None  # another process does not hold this group
    new = ask()
    assert new is not None and new.trial.index == 2
    assert new.trial.params == replay([2.5])[2]
    assert new.spec["train"]["lr"] == new.trial.params["train.lr"]
    with session_for(db_url) as s:
        job = s.get(Job, new.trial.job_id)
        assert (job.status, job.owner, job.worker, job.attempts) == (JobStatus.running, "p1", "w", 1)
        assert s.get(Reservation, res).trial_ids == [*ids, new.trial.id]
        assert s.get(Trial, new.trial.id).status == "running"
        assert dbs.queued_groups(s) == []  # never queued: nothing for the scheduler to place
    # trial 3, the batch's last, is due with trial 2 (told what trial 2 was told), trial 1 running
    last = ask()
    assert last is not None and last.trial.index == 3
    assert last.trial.params == replay([2.5])[3]
    assert ask() is None  # the batch has all its trials


def test_the_trials_due_together_join_the_group_in_one_ask(db_url: str) -> None:
    settings = Settings(database_url=db_url)
    sel, res, ids = running_group(db_url)

    def due() -> list[int]:
        got = ask_due(settings, selection_id=sel, reservation_id=res, worker="w", owner="p1")
        return [n.trial.index for n in got]

    assert due() == []  # trial 2 waits for trial 0
    end(db_url, ids[0], 2.5)
    assert due() == [2, 3]
    with session_for(db_url) as s:
        assert s.get(Reservation, res).trial_ids[2:] == [t.id for t in dbsel.get_selection(s, sel).trials[2:]]
    assert due() == []


def test_grow_asks_when_no_group_runs(db_url: str) -> None:
    settings = Settings(database_url=db_url)
    sel, res, ids = running_group(db_url)
    end(db_url, ids[0], 2.5)
    end(db_url, ids[1], 2.0)
    with session_for(db_url) as s:
        dbsel.free_group(s, reservation_id=res, worker="w", owner="p1")
        s.commit()
    added = grow(settings, selection_id=sel)
    assert len(added) == 2
    with session_for(db_url) as s:
        got = sorted((t.index, t.params, t.status) for t in dbsel.get_selection(s, sel).trials)
    want = replay([2.5, 2.0])
    assert [(i, p) for i, p, _ in got] == list(enumerate(want))
    assert [st for *_, st in got[2:]] == ["queued", "queued"]
