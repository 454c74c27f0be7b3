"""How a node of a gang ends its part once its trainer exited (workers/gang.py GangEnd), on a real
SQLite database migrated by Alembic: who ends the job, when the gang goes back (counted or not),
and what fails at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from core.settings import Settings
from db import gangs as dbg
from db import ingest as dbi
from db import jobs as dbj
from db.connection import session_for
from db.migrate import upgrade
from db.models import Job, JobEvent, JobStatus, Reservation
from tests.conftest import TINY_SPEC
from workers.attempt import drop_checkpoints_past
from workers.gang import GangEnd, execute_gang_node
from workers.relay import Relay
from workers.supervise import Outcome


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[Settings]:
    url = f"sqlite:///{tmp_path / 'gang.db'}"
    upgrade(url)
    # nothing listens on port 1: live publishing fails at once and is only logged
    yield Settings(database_url=url, broker_url="redis://127.0.0.1:1/0", data_dir=tmp_path, db_retry_s=1)


def _running_gang(settings: Settings) -> list[dbj.Attempt]:
    url = settings.database_url
    with session_for(url) as s:
        job = dbj.create_job(s, name="g", spec={}, steps=9, world_size=4)
        s.get(Job, job.id).nnodes = 2
        for r in range(2):
            s.add(Reservation(job_id=job.id, worker=f"w{r}", node_rank=r, nnodes=2, slots=2, attempt=0))
        s.commit()
        head = dbj.claim_job(s, job_id=job.id, owner="p0", worker="w0", lease_s=30)
        assert dbg.claim_node(s, job_id=job.id, node_rank=0, worker="w0", owner="p0", lease_s=30) == head
        member = dbg.claim_node(s, job_id=job.id, node_rank=1, worker="w1", owner="p1", lease_s=30)
    assert head is not None and member is not None
    return [head, member]


def _end(
    settings: Settings, attempt: dbj.Attempt, node_rank: int, *, rc: int, out: Outcome | None = None
) -> str:
    relay = Relay(settings, targets={}, on_fenced=lambda _k: None)
    try:
        ender = GangEnd(
            settings=settings, attempt=attempt, node_rank=node_rank, worker=f"w{node_rank}", relay=relay
        )
        return ender.decide(rc=rc, out=out or Outcome(), memory_limit=None)
    finally:
        relay.close()


def _result(settings: Settings, job_id: int, **result: object) -> None:
    with session_for(settings.database_url) as s:
        s.get(Job, job_id).result = {"steps": 9, "stopped": False, **result}
        s.commit()


def _job(settings: Settings, job_id: int) -> tuple[Job, list[dict], int]:
    with session_for(settings.database_url) as s:
        job = dbj.get_job(s, job_id)
        events = [e.data or {} for e in s.scalars(select(JobEvent).where(JobEvent.kind == "status")).all()]
        held = len(s.scalars(select(Reservation).where(Reservation.job_id == job_id)).all())
        return job, events, held


def test_node_0_ends_the_job_once_a_result_printed_on_any_node_is_in(settings: Settings) -> None:
    head, member = _running_gang(settings)
    # node 1 holds global rank 0: its relay applies the result a moment after node 0's trainer ended
    threading.Timer(0.5, _result, args=(settings, head.job_id)).start()
    assert _end(settings, head, 0, rc=0) == "succeeded"
    job, _, held = _job(settings, head.job_id)
    assert job.status == JobStatus.succeeded and held == 0
    # the member, done too, finds the gang over: fenced, it writes nothing
    assert _end(settings, member, 1, rc=0) == "lost"


def test_a_member_stays_until_node_0_ends_the_job(settings: Settings) -> None:
    head, member = _running_gang(settings)
    _result(settings, head.job_id)
    t0 = time.monotonic()
    finisher = threading.Timer(0.8, _end, args=(settings, head, 0), kwargs={"rc": 0})
    finisher.start()
    assert _end(settings, member, 1, rc=0) == "done"
    assert time.monotonic() - t0 >= 0.8, "it left before node 0 ended the job"
    finisher.join()
    assert _job(settings, head.job_id)[0].status == JobStatus.succeeded


def test_a_failed_trainer_on_any_node_sends_the_gang_back_counted(settings: Settings) -> None:
    head, member = _running_gang(settings)
    out = Outcome(error="RuntimeError: Connection closed by peer (rank 2 of 4)")
    assert _end(settings, member, 1, rc=1, out=out) == "queued"
    job, events, held = _job(settings, head.job_id)
    assert (job.status, job.owner, held) == (JobStatus.queued, None, 0)
    assert events[-1]["gang_restart"] == 1
    assert events[-1]["reason"] == "node 1 on w1: RuntimeError: Connection closed by peer (rank 2 of 4)"
    # node 0, whose trainer failed the same way a moment later, is fenced off
    assert _end(settings, head, 0, rc=1, out=out) == "lost"


def test_a_refused_spec_fails_at_once(settings: Settings) -> None:
    head, _ = _running_gang(settings)
    assert _end(settings, head, 0, rc=1, out=Outcome(error="bad spec: model.layers must be >= 1")) == "failed"
    job, events, _ = _job(settings, head.job_id)
    assert job.error == "node 0 on w0: bad spec: model.layers must be >= 1"
    assert not any(e.get("gang_restart") for e in events)


@pytest.mark.parametrize(
    ("node", "error"),
    [
        (0, "TrainingError: loss is nan at step 3; lower train.lr (rank 0 of 4)"),
        (0, "user code failed: data.entry: NameError"),
        # the job's requirements (workers/pyenv.py) fail the same way on every attempt
        (1, "environment: resolving the requirements failed: error: no-such-pkg was not found"),
    ],
)
def test_a_nan_loss_the_users_code_or_a_failed_environment_fails_the_gang_at_once(
    settings: Settings, node: int, error: str
) -> None:
    head, member = _running_gang(settings)
    assert _end(settings, (head, member)[node], node, rc=1, out=Outcome(error=error)) == "failed"
    job, events, _ = _job(settings, head.job_id)
    assert job.error == f"node {node} on w{node}: {error}"
    assert not any(e.get("gang_restart") for e in events)


def test_a_rank_killed_by_a_signal_is_named_and_the_gang_restarts(settings: Settings) -> None:
    """torchrun's failure summary (what it prints on stderr when a rank dies) names the rank."""
    head, _ = _running_gang(settings)
    out = Outcome(error="RuntimeError: Connection closed by peer (rank 0 of 4)")
    summary = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_19:35:18
  host      : w0
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242"""
    out.stderr_tail.extend(summary.splitlines())
    assert _end(settings, head, 0, rc=1, out=out) == "queued"
    _, events, _ = _job(settings, head.job_id)
    assert events[-1]["reason"].startswith(
        "node 0 on w0: rank 1 (pid 4242) on w0 was killed by SIGKILL (exit code -9)"
    )


def test_a_stop_from_another_nodes_warm_shutdown_gives_the_gang_back_uncounted(settings: Settings) -> None:
    head, member = _running_gang(settings)
    # node 1's worker drained: every rank stopped at one step, so node 0's trainer exited 0 with a
    # result that says so; whichever node ends first gives the gang back, never as succeeded
    _result(settings, head.job_id, stopped=True, steps=4)
    assert _end(settings, head, 0, rc=0) == "queued"
    assert _end(settings, member, 1, rc=0, out=Outcome(stopped="drain")) == "lost"
    job, events, _ = _job(settings, head.job_id)
    assert job.status == JobStatus.queued
    assert events[-1] == {"reason": "a node of the gang shut down; it resumes from its checkpoint"}


def test_a_cancel_ends_the_gang_cancelled(settings: Settings) -> None:
    head, member = _running_gang(settings)
    with session_for(settings.database_url) as s:
        dbj.request_cancel(s, job_id=head.job_id)
    threading.Timer(0.5, _end, args=(settings, head, 0), kwargs={"rc": 0}).start()
    assert _end(settings, member, 1, rc=0) == "done"
    assert _job(settings, head.job_id)[0].status == JobStatus.cancelled


def test_a_node_whose_node_0_never_comes_gives_its_claim_back(settings: Settings) -> None:
    with session_for(settings.database_url) as s:
        job = dbj.create_job(s, name="g", spec={}, steps=9, world_size=4)
        for r in range(2):
            s.add(Reservation(job_id=job.id, worker=f"w{r}", node_rank=r, nnodes=2, slots=2, attempt=0))
        s.commit()
    # node 0's message was lost: node 1 waits gang_join_s for its endpoint, then says why and
    # leaves its reservation unclaimed for the scheduler to send the task again
    quick = settings.model_copy(update={"gang_join_s": 1.0})
    assert execute_gang_node(job.id, node_rank=1, nnodes=2, settings=quick, worker="w1") == "waited"
    with session_for(settings.database_url) as s:
        row = s.scalars(
            select(Reservation).where(Reservation.job_id == job.id, Reservation.node_rank == 1)
        ).one()
        assert (row.owner, row.claimed_at, row.lease_until) == (None, None, None)
        [log] = dbi.events_after(s, job_id=job.id, kinds=["log"])
        assert log.message == "node 1 on w1: waited 1 s (gang_join_s) for node 0's rendezvous endpoint"
        assert dbj.get_job(s, job.id).status == JobStatus.queued


def test_a_checkpoint_step_missing_a_piece_is_dropped(tmp_path: Path) -> None:
    # a pipeline's two stage folders; the gang died after stage 0 wrote step 10, before stage 1
    # did: every rank must resume from step 5, and steps past the applied lines go too
    for folder, steps in (("pp0-tp0", (5, 10, 15)), ("pp1-tp0", (5, 15))):
        (tmp_path / folder).mkdir()
        for at in steps:
            (tmp_path / folder / f"step-{at:08d}.pt").write_bytes(b"x")
    dropped = drop_checkpoints_past(tmp_path, 12)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in dropped) == [
        "pp0-tp0/step-00000010.pt",
        "pp0-tp0/step-00000015.pt",
        "pp1-tp0/step-00000015.pt",
    ]
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("step-*.pt"))
    assert left == ["pp0-tp0/step-00000005.pt", "pp1-tp0/step-00000005.pt"]


def test_a_preempted_gang_goes_back_uncounted_with_the_schedulers_reason(settings: Settings) -> None:
    head, member = _running_gang(settings)
    with session_for(settings.database_url) as s:
        job = s.get(Job, head.job_id)
        job.preempt_requested, job.wait_reason = True, "preempted by job 7"
        s.commit()
    # every node saw the flag and stopped its trainer at one step; the first to end gives it back
    assert _end(settings, member, 1, rc=0) == "queued"
    assert _end(settings, head, 0, rc=0) == "lost"
    job, events, held = _job(settings, head.job_id)
    assert (job.status, job.preempt_requested, held) == (JobStatus.queued, False, 0)
    assert events[-1] == {"reason": "preempted by job 7; the gang resumes from its checkpoint"}


SPEC = {**TINY_SPEC, "train": {**TINY_SPEC["train"], "optimizer": "adamw"}, "max_runtime_s": 5}


def test_a_gang_nodes_max_runtime_counts_every_attempt(settings: Settings) -> None:
    # the job's earlier attempts already ran 6 s of its 5 s limit (jobs.run_seconds): the new
    # attempt gets none of it, as a one-node job's does (workers/execute.py), not a fresh 5 s
    with session_for(settings.database_url) as s:
        job = dbj.create_job(s, name="g", spec=SPEC, steps=9, world_size=4)
        row = s.get(Job, job.id)
        row.nnodes, row.run_seconds = 2, 6.0
        for r in range(2):
            s.add(Reservation(job_id=job.id, worker=f"w{r}", node_rank=r, nnodes=2, slots=2, attempt=0))
        s.commit()
    assert execute_gang_node(job.id, node_rank=0, nnodes=2, settings=settings, worker="w0") == "lost"
    done, _, held = _job(settings, job.id)
    assert done.status == JobStatus.failed
    assert "max_runtime_s (5 s over all its attempts, 6.0 s of it in earlier attempts)" in done.error
    assert held == 0


def test_node_0_records_the_gangs_run_time_over_its_attempts(settings: Settings) -> None:
    head, member = _running_gang(settings)
    with session_for(settings.database_url) as s:
        for attempt, node_rank, ran in ((member, 1, 9.0), (head, 0, 7.5)):
            got = dbg.apply_gang_lines(
                s,
                attempt=attempt,
                node_rank=node_rank,
                lines=dbi.JobLines(),
                lease_s=30,
                now=dbj.db_now(s),
                run_seconds=ran,
            )
            assert got is not None
        s.commit()
    # node 0's clock is the job's (it holds the job's lease); a node > 0's is not written
    assert _job(settings, head.job_id)[0].run_seconds == 7.5


def test_a_drain_gives_the_gang_back_with_the_launchers_reason(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a launcher that drains (Slurm's signal ahead of a time limit) says why: the reason the gang
    # goes back to the queue with names it, not a generic shutdown
    import workers.supervise as sup

    monkeypatch.setattr(sup, "_DRAIN_WHY", [])
    monkeypatch.setattr(sup, "DRAIN", __import__("threading").Event())
    head, _member = _running_gang(settings)
    sup.drain("slurm: the time limit is near (SIGUSR1)")
    assert _end(settings, head, 0, rc=0, out=Outcome(stopped="drain")) == "queued"
    job, events, _held = _job(settings, head.job_id)
    assert job.status == JobStatus.queued
    assert events[-1] == {
        "reason": "slurm: the time limit is near (SIGUSR1); the gang resumes from its checkpoint"
    }
