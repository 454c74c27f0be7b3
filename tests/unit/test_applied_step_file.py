"""The worker's relay keeps the checkpoint folder's applied-step file (jobrules/applied.py) equal to
the job's applied_step after each commit, through the real Relay into a real database (SQLite and
PostgreSQL): the trainer's pruning reads it to keep the checkpoint a resume needs."""

from __future__ import annotations

import json
import time
from pathlib import Path

from core.messages import parse_line
from core.settings import Settings
from db import jobs as dbj
from db.connection import session_for
from db.models import Job
from jobrules.applied import APPLIED_FILE, read_applied_step
from workers.relay import Relay, Target


def _checkpoint(seq: int, step: int) -> str:
    return json.dumps(
        {"seq": seq, "kind": "event", "event": "checkpoint", "data": {"step": step}, "time": time.time()}
    )


def _metric(seq: int, step: int) -> str:
    return json.dumps(
        {"seq": seq, "kind": "metric", "step": step, "name": "loss", "value": 1.0, "time": time.time()}
    )


def _job_relay(db_url: str, folder: Path) -> tuple[int, Relay]:
    with session_for(db_url) as s:
        job = dbj.create_job(s, name="j", spec={"train": {"steps": 20}})
        attempt = dbj.claim_job(s, job_id=job.id, owner="w", worker="w", lease_s=30)
        assert attempt is not None
    settings = Settings(database_url=db_url, broker_url="redis://127.0.0.1:9/0", lease_s=30, db_retry_s=5)
    target = Target(attempt=attempt, channels=(), checkpoints=folder)
    # its flusher never ticks: the test flushes
    return job.id, Relay(settings, targets={None: target}, on_fenced=lambda _k: None, flush_s=3600)


def _feed(relay: Relay, *lines: str) -> None:
    for raw in lines:
        relay.add(None, parse_line(raw))


def test_the_relay_writes_the_applied_step_after_each_commit_that_moves_it(
    db_url: str, tmp_path: Path
) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    job_id, relay = _job_relay(db_url, folder)
    _feed(relay, _metric(0, 1), _metric(1, 2))
    relay.flush()
    assert read_applied_step(folder / APPLIED_FILE) == 0  # the job's applied_step: nothing yet
    _feed(relay, _metric(2, 4), _checkpoint(3, 4), _metric(4, 8), _checkpoint(5, 8))
    relay.flush()
    with session_for(db_url) as s:
        assert s.get(Job, job_id).applied_step == 8
    assert read_applied_step(folder / APPLIED_FILE) == 8
    # a checkpoint event below the applied step (a re-run after a resume) never lowers it
    _feed(relay, _checkpoint(6, 4))
    relay.flush()
    assert read_applied_step(folder / APPLIED_FILE) == 8
    assert sorted(p.name for p in folder.iterdir()) == [APPLIED_FILE]  # no temporary left
    assert relay.close()


def test_a_removed_checkpoint_folder_is_not_made_again(db_url: str, tmp_path: Path) -> None:
    """A trial whose checkpoints were removed (`checkpoints: none`, or a lost `best`): the relay's
    later commits leave its folder gone."""
    folder = tmp_path / "trial-0"
    _, relay = _job_relay(db_url, folder)
    _feed(relay, _metric(0, 4), _checkpoint(1, 4))
    relay.flush()
    assert not folder.exists()
    assert relay.close()
