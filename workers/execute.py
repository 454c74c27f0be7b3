"""Runs one job: take its lease, launch the trainer in a subprocess, apply its lines, end it.

Plain functions, tested without Celery; workers/tasks.py only wraps them. The trainer runs in a
child process (torchrun when it needs several ranks) because a Celery prefork worker must not fork
CUDA or process groups itself.

Exactly once: the final status is written only after the trainer exited and every line it wrote
is applied; a kill anywhere before that leaves the job `running` under a lease nobody renews, and
whoever takes it next resumes from the latest checkpoint whose lines are all in the database
(checkpoints past it are dropped first), so every metric step is stored once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from core.broker import JOBS_CHANNEL, job_channel
from core.messages import Message
from core.settings import Settings
from core.storage import StorageError, checkpoints_prefix, get_storage
from db.engine import session_for
from db.ingest import last_status_event
from db.jobs import (
    Attempt,
    NotFound,
    claim_job,
    finish_job,
    free_job_reservations,
    get_job,
    lease_left_s,
    release_job,
    reserved_here,
    restart_job,
    stop_flags,
)
from db.models import TERMINAL, JobStatus
from db.quotas import quota_gate
from jobrules.applied import write_applied_step
from jobrules.parallel import checkpoint_pieces
from jobrules.restarts import max_restarts
from workers import pyenv
from workers.ckpt_sync import (
    Mirror,
    Uploader,
    job_reporter,
    local_checkpoints,
    parse_step,
    past_or_partial,
    prune_local,
    storage_failure,
)
from workers.failures import infrastructure_failure, oom_kill_count
from workers.hardware import HardwareSampler
from workers.limits import memory_limit_bytes, out_of_memory_error, runtime_error, runtime_limit_s
from workers.logcap import LogCap
from workers.relay import Relay, Target, retry_db
from workers.supervise import Ask, Outcome, supervise
from workers.workspace import workspace_args

log = logging.getLogger(__name__)

_OWNER: dict[int, str] = {}


def owner_id() -> str:
    """This worker process start's unique id: leases belong to it, never to a reusable name."""
    pid = os.getpid()
    if pid not in _OWNER:  # a forked pool child gets its own
        _OWNER[pid] = f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:12]}"
    return _OWNER[pid]


def trainer_args(*, spec_path: Path, ckpt_dir: Path, stop_file: Path) -> list[str]:
    """`python -m trainer`'s own arguments (one node's torchrun in workers/gang.py takes them too)."""
    return ["--spec", str(spec_path), "--checkpoint-dir", str(ckpt_dir), "--stop-file", str(stop_file)]


def trainer_command(*, world_size: int, spec_path: Path, ckpt_dir: Path, stop_file: Path) -> list[str]:
    args = ["-m", "trainer", *trainer_args(spec_path=spec_path, ckpt_dir=ckpt_dir, stop_file=stop_file)]
    if world_size == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(world_size),
        # each rank's stderr also to the console, prefixed with its rank (workers/logcap.py); the
        # raw per-rank files go to the job folder (one sub-folder per run), not to /tmp
        "--tee",
        "2",
        "--log-dir",
        str(spec_path.parent / "rank-logs"),
        *args,
    ]


def drop_checkpoints_past(ckpt_dir: Path, step: int) -> list[Path]:
    """Checkpoints written after the last step whose lines are all in the database: resuming from
    one would lose the metric lines of the steps before it, so the new attempt re-runs them.
    Sub-folders too: the ranks of a pipeline or tensor layout each write their piece in one, and a
    step whose pieces are not all there (a rank died between the writes, on its node or another)
    is dropped as well, or the ranks would resume from different steps (workers/ckpt_sync.py
    past_or_partial, which a store's copies follow too)."""
    here = local_checkpoints(ckpt_dir)
    found: dict[str, set[int]] = {}
    for rel in here:
        folder, _, name = rel.rpartition("/")
        found.setdefault(folder, set()).add(parse_step(name))
    drop = past_or_partial(found, step)
    dropped = []
    for rel, p in sorted(here.items()):
        folder, _, name = rel.rpartition("/")
        if (folder, parse_step(name)) in drop:
            p.unlink(missing_ok=True)
            dropped.append(p)
    return dropped


def mark_applied(ckpt_dir: Path, step: int) -> None:
    """Before the trainer starts: the job's applied step into its checkpoint folder, which the
    trainer's pruning reads (jobrules/applied.py; the relay rewrites it as the step moves). A
    write that fails only warns: the trainer then prunes by the file an earlier attempt left (a
    step at or below this one, still one a resume may use) or, without one, by count alone."""
    try:
        write_applied_step(ckpt_dir, step, create=True)
    except OSError as e:
        log.warning("could not write the applied step to %s: %s", ckpt_dir, e)


class QuotaWait(Exception):
    """The job's owner is at their quota: the job waits in the queue (the reason is on the job)."""


def take_lease(
    settings: Settings,
    *,
    job_id: int,
    worker: str,
    kind: str = "job",
    claim=None,  # noqa: ANN001
) -> Attempt | None:
    """Claim the job; when it is running under another owner's live lease (a redelivered message
    after that owner's process died), wait for the lease to run out and take it then. A live
    owner keeps renewing, so after two lease periods this gives up (a true duplicate). A job
    (kind `job`) is claimed only where the scheduler reserved it; a stale message elsewhere is
    skipped at once."""
    deadline = time.monotonic() + 2 * settings.lease_s
    while True:
        with session_for(settings.database_url) as s:
            if kind == "job" and not reserved_here(s, job_id=job_id, worker=worker):
                return None
            # the scheduler checked the quota when it reserved; checked again with the claim in
            # one transaction (db/quotas.py), so a quota lowered meanwhile still holds: the job
            # then gives its reservation back and waits with the reason
            if kind == "job" and (why := quota_gate(s, job_id=job_id, defaults=settings.quota_defaults)):
                free_job_reservations(s, job_id=job_id)
                s.commit()
                raise QuotaWait(why)
            attempt = claim_job(
                s,
                job_id=job_id,
                owner=owner_id(),
                worker=worker,
                lease_s=settings.lease_s,
                kind=kind,
                reserved=kind == "job",
            )
            if attempt is not None:
                return attempt
            left = lease_left_s(s, job_id=job_id)
        if left is None or time.monotonic() > deadline:
            return None
        time.sleep(min(max(left, 0.0) + 0.2, 2.0))


def publish_status(relay: Relay, *, job_id: int) -> None:
    """Announce the job's latest status event (already in the database, with its id) live."""
    with session_for(relay.settings.database_url) as s:
        ev = last_status_event(s, job_id=job_id)
    if ev is None:
        return
    body = {
        "type": "event",
        "id": ev.id,
        "kind": "status",
        "message": ev.message,
        "data": ev.data,
        "time": ev.time,
    }
    relay.publish(body, channels=(job_channel(job_id), *extra_channels(relay, job_id)))
    relay.publish({"job_id": job_id, "status": ev.message}, channels=(JOBS_CHANNEL,))


def extra_channels(relay: Relay, job_id: int) -> tuple[str, ...]:
    for t in relay.targets.values():
        if t.attempt.job_id == job_id:
            return tuple(c for c in t.channels if c != job_channel(job_id))
    return ()


def execute_job(job_id: int, *, settings: Settings, worker: str) -> str:
    """Run job `job_id` to its end. Returns the final status; 'skipped' when another live
    attempt has it (or it ended); 'queued' when a warm shutdown gave it back; 'lost' when the
    attempt was fenced off or the database stayed unreachable (the lease then runs out)."""
    try:
        attempt = retry_db(settings, "claim", lambda: take_lease(settings, job_id=job_id, worker=worker))
    except QuotaWait:
        return "waiting"
    if attempt is None:
        return "skipped"
    with session_for(settings.database_url) as s:
        job = get_job(s, job_id)
        spec, world_size, applied_step = job.spec, job.world_size, job.applied_step
        used_s = job.run_seconds or 0.0

    workdir = settings.data_dir / "jobs" / str(job_id)
    ckpt_dir = workdir / "checkpoints"
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    stop_file = workdir / "stop"
    cmd = trainer_command(world_size=world_size, spec_path=spec_path, ckpt_dir=ckpt_dir, stop_file=stop_file)

    target = Target(attempt=attempt, channels=(job_channel(job_id),), run_base=used_s, checkpoints=ckpt_dir)
    relay = Relay(
        settings,
        targets={None: target},
        on_fenced=lambda _key: None,  # the poll below sees relay.fenced and kills the trainer
    )
    try:
        uploader = restore_checkpoints(
            settings,
            ckpt_dir=ckpt_dir,
            job_id=job_id,
            applied_step=applied_step,
            relay=relay,
            parallel=spec.get("parallel") or {},
        )
        cmd += workspace_args(spec, settings=settings, workdir=workdir)
    except StorageError as e:
        return fail_unstarted(settings, attempt=attempt, relay=relay, error=storage_failure(e))
    publish_status(relay, job_id=job_id)

    # the limit counts every attempt: the time earlier attempts ran is already used up
    runtime_s = runtime_limit_s(spec, service_max_s=settings.max_job_runtime_s)

    def poll() -> Ask:
        if relay.fenced or relay.broken:
            return Ask.kill
        if target.run_seconds() > runtime_s:
            out.error = runtime_error(runtime_s, used_s)
            return Ask.kill
        with session_for(settings.database_url) as s:
            cancel, preempt = stop_flags(s, job_id=job_id)
        if preempt and not cancel and out.stopped is None:
            # a higher-priority job needs the slots: stop and checkpoint like a warm shutdown,
            # and the job goes back to the queue (end_attempt)
            out.stopped = "drain"
        return Ask.stop if cancel or preempt else Ask.none

    out = Outcome()
    mem_limit = memory_limit_bytes(spec)
    oom_before = oom_kill_count()
    rc = run_in_job_env(
        settings,
        cmd,
        spec,
        job_id=job_id,
        relay=relay,
        poll=poll,
        stop_file=stop_file,
        workdir=workdir,
        out=out,
        memory_limit=mem_limit,
        what=f"job {job_id} attempt {attempt.attempt}",
        uploader=uploader,
    )
    if rc is None:
        return "lost"
    # the job's end frees its reservation; the scheduler places the next queued job
    status = end_attempt(
        settings, attempt=attempt, rc=rc, out=out, relay=relay, memory_limit=mem_limit, oom_before=oom_before
    )
    relay.drain_live()
    prune_at_end(settings, attempt=attempt, ckpt_dir=ckpt_dir, mirrors=uploader.mirrors if uploader else ())
    return status


def restore_checkpoints(
    settings: Settings,
    *,
    ckpt_dir: Path,
    job_id: int,
    applied_step: int,
    relay: Relay,
    parallel: dict[str, Any],
) -> Uploader | None:
    """Before the trainer starts: the job's checkpoints as the rule allows (drop_checkpoints_past),
    from the store when it is not the data dir (workers/ckpt_sync.py), its applied step for the
    trainer's pruning (mark_applied), and the thread that uploads the new ones (None with the
    default store: the trainer's folder is the store). `parallel`: the spec's layout, which sets the
    files one checkpoint is written as (jobrules/parallel.py checkpoint_pieces), which the uploads'
    deletions in the store wait for (ckpt_sync.store_floor). StorageError when the store cannot be read."""
    storage = get_storage(settings)
    if storage.is_data_dir:
        if ckpt_dir.is_dir():
            drop_checkpoints_past(ckpt_dir, applied_step)
        mark_applied(ckpt_dir, applied_step)
        return None
    mirror = Mirror(
        storage=storage, local=ckpt_dir, prefix=checkpoints_prefix(job_id), pieces=checkpoint_pieces(parallel)
    )
    restored = mirror.restore(applied_step=applied_step)
    mark_applied(ckpt_dir, applied_step)
    report = job_reporter(settings.database_url, [job_id])
    if restored.step is not None:
        report(
            f"restored checkpoint step {restored.step} from {storage.url} ({restored.downloaded} file(s) fetched)"
        )
    return Uploader(
        [mirror], interval_s=settings.storage_sync_s, report=report, allowed=lambda: not relay.fenced
    ).start()


def prune_at_end(settings: Settings, *, attempt: Attempt, ckpt_dir: Path, mirrors: Sequence[Mirror]) -> None:
    """Once this attempt ended the job (succeeded, failed or cancelled, every line applied): the
    pruning the trainer no longer does. Its last save read an applied-step file that lagged the
    last lines, so up to every checkpoint the relay had not applied then was still there. The
    folder (ckpt_sync.prune_local) and, with a store, the store's copies of it (`mirrors`,
    Mirror.prune_store) keep what `checkpoint_keep` leaves at the job's final applied step. A
    selection's trial is a job: its folder and its mirror (workers/selection.py). Never fails the
    attempt: a store or disk error only warns (the copies stay, as before)."""
    keep = settings.checkpoint_keep
    if keep <= 0:
        return
    try:
        with session_for(settings.database_url) as s:
            job = get_job(s, attempt.job_id)
            if job.status not in TERMINAL or job.attempts != attempt.attempt:
                return
            applied = job.applied_step
        prune_local(ckpt_dir, keep=keep, applied=applied)
        for mirror in mirrors:
            mirror.prune_store(keep=keep, applied=applied)
    except (OSError, StorageError, SQLAlchemyError, NotFound) as e:  # NotFound: deleted meanwhile
        log.warning("job %s: checkpoints not pruned at its end: %s", attempt.job_id, e)


def fail_unstarted(settings: Settings, *, attempt: Attempt, relay: Relay, error: str) -> str:
    """End an attempt whose trainer never started `failed` with `error` (an operator's requeue runs
    it again, from its checkpoint in the store)."""

    def end() -> str:
        with session_for(settings.database_url) as s:
            if finish_job(s, attempt=attempt, status=JobStatus.failed, error=error) is None:
                return "lost"
        publish_status(relay, job_id=attempt.job_id)
        return str(JobStatus.failed)

    log.error("job %s attempt %s: %s", attempt.job_id, attempt.attempt, error)
    status = retry_db(settings, "final status", end)
    relay.close()
    relay.drain_live()
    return status


def run_in_job_env(
    settings: Settings,
    cmd: list[str],
    spec: dict[str, Any],
    *,
    job_id: int,
    relay: Relay,
    workdir: Path,
    **attempt: Any,
) -> int | None:
    """`run_attempt` (given `attempt`'s other arguments) in the job's own requirements
    (workers/pyenv.py): built (or found) first, by this worker under the job's lease, or refused;
    released once the trainer has exited."""
    env = pyenv.for_job(spec, settings=settings, workdir=workdir, relay=relay, job_id=job_id)
    rc = run_attempt(settings, cmd, relay=relay, workdir=workdir, env=env, **attempt)
    env.release()
    return rc


def run_attempt(
    settings: Settings,
    cmd: list[str],
    *,
    relay: Relay,
    poll: Callable[[], Ask],
    stop_file: Path,
    workdir: Path,
    out: Outcome,
    memory_limit: int | None,
    what: str,
    env: pyenv.PreparedEnv | None = None,
    uploader: Uploader | None = None,
    still_ours: Callable[[], bool] = lambda: True,
) -> int | None:
    """Run the trainer under `poll`, relaying its lines and its own output (workers/logcap.py) and
    sampling its hardware (workers/hardware.py), and wait for every line to be applied.
    Returns its exit code, or None when the attempt was lost (fenced off, or the database stayed
    unreachable: the lease then runs out). `env`: the job's own packages (workers/pyenv.py); when
    they failed, no trainer runs and the attempt ends with their error (exit code 1). `uploader`
    hears of each checkpoint the trainer reports and syncs once more when it has exited, if the
    attempt is `still_ours()` and not fenced off: before the relay closes, whose thread keeps the
    lease alive meanwhile."""
    if env is not None and env.error:
        out.error = env.error
        if uploader is not None:
            uploader.stop(final=False)  # no trainer ran: nothing new to upload
        return pyenv.without_trainer(relay)

    def emit_log(rank: int | None, stream: str, text: str, at: float) -> None:
        relay.add(None, Message(kind="log", message=text, time=at, data={"rank": rank, "stream": stream}))

    channels = next(iter(relay.targets.values())).channels

    def live_log(rank: int | None, stream: str, text: str, at: float) -> None:
        # past the stored head: shown live, stored only if it ends up in the tail
        body = {"type": "live_log", "message": text, "time": at, "rank": rank, "stream": stream}
        relay.publish(body, channels=channels)

    cap = LogCap(emit_log, head=settings.log_head_lines, tail=settings.log_tail_lines, live=live_log)
    step = [0]

    def on_message(msg: Message) -> None:
        if msg.kind == "metric":
            step[0] = max(step[0], msg.step)
        relay.add(None, msg)
        if uploader is not None and msg.kind == "event" and msg.message == "checkpoint":
            uploader.wake()

    def emit_hw(name: str, value: float) -> None:
        # seq None: applied whatever the attempt's sequence; stored once per (name, step)
        relay.add(None, Message(kind="metric", step=step[0], name=name, value=value))

    sampler: list[HardwareSampler] = []
    out.rank = 0 if "torch.distributed.run" not in cmd else None
    rc = supervise(
        cmd + (env.args if env is not None else []),
        on_message=on_message,
        on_output=lambda rank, stream, text: cap.add(rank=rank, stream=stream, text=text),
        on_start=lambda pid: sampler.append(
            HardwareSampler(pid, emit=emit_hw, every_s=settings.hw_sample_s).start()
        ),
        poll=poll,
        stop_file=stop_file,
        stderr_log=workdir / "stderr.log",
        grace_s=settings.cancel_grace_s,
        shutdown_grace_s=settings.shutdown_grace_s,
        out=out,
        memory_limit=memory_limit,
    )
    for sm in sampler:
        sm.stop()
    cap.close()
    if uploader is not None:
        uploader.stop(final=not relay.fenced and not relay.broken and still_ours())
    if not relay.close() or relay.fenced:
        log.warning("%s: %s", what, relay.broken or "fenced off")
        return None
    return rc


def end_attempt(
    settings: Settings,
    *,
    attempt: Attempt,
    rc: int,
    out: Outcome,
    relay: Relay,
    memory_limit: int | None = None,
    oom_before: int | None = None,
) -> str:
    """Every line is applied: write the attempt's end (fenced), or give the job back. A trainer
    process killed by a signal its worker did not send (the OOM killer, a kill -9) is the
    infrastructure's failure: the job goes back to the queue up to its max_restarts
    (workers/failures.py). `oom_before`: the memory cgroup's OOM-kill count at the start."""
    job_id = attempt.job_id
    oom = out_of_memory_error(error=out.error, stderr_tail=list(out.stderr_tail), limit=memory_limit)
    infra = None
    if rc != 0 and out.stopped is None and oom is None:
        infra = infrastructure_failure(rc=rc, stderr="\n".join(out.stderr_tail), oom_before=oom_before)

    def decide() -> str:
        with session_for(settings.database_url) as s:
            job = get_job(s, job_id)
            if job.cancel_requested:
                status, error = JobStatus.cancelled, None
            elif out.stopped == "drain":
                # a preemption (the scheduler set the flag and its reason) or a warm shutdown
                why = (
                    f"{job.wait_reason}; resumes from its checkpoint"
                    if job.preempt_requested and job.wait_reason
                    else "the worker shut down; resumes from its checkpoint"
                )
                return "queued" if release_job(s, attempt=attempt, reason=why) else "lost"
            elif rc == 0 and job.result is not None:
                status, error = JobStatus.succeeded, None
            elif infra is not None:
                got = restart_job(s, attempt=attempt, reason=infra, max_restarts=max_restarts(job.spec))
                if got is None:
                    return "lost"
                publish_status(relay, job_id=job_id)
                return got
            else:
                status, error = JobStatus.failed, oom or out.failure(rc)
            eid = finish_job(s, attempt=attempt, status=status, error=error)
            if eid is None:
                return "lost"
            publish_status(relay, job_id=job_id)
            return str(status)

    return retry_db(settings, "final status", decide)
