"""Runs one job: take its lease, launch the trainer in a subprocess, apply its lines, end it.

Plain functions, tested without Celery; workers/tasks.py only wraps them. The trainer runs in a
child process (torchrun when it needs several ranks) because a Celery prefork worker must not fork
CUDA or process groups itself. The attempt's phases are workers/attempt.py's; what is a job's own
is here: its one-node command, its stop poll (cancel, preemption, its runtime limit) and its end.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from core.broker import job_channel
from core.safe_files import write_fresh
from core.settings import Settings
from db.connection import session_for
from db.jobs import Attempt, finish_job, get_job, release_job, restart_job, stop_flags
from db.models import JobStatus
from jobrules.divergence import judge
from jobrules.restarts import max_restarts
from jobrules.spec import JobSpec, stored_job
from workers import pyenv, spare
from workers.attempt import (
    AttemptRun,
    OneTarget,
    QuotaWait,
    prune_at_end,
    publish_status,
    restore_checkpoints,
    take_lease,
)
from workers.ckpt_sync import Uploader
from workers.failures import infrastructure_failure
from workers.limits import memory_limit_bytes, runtime_error, runtime_limit_s
from workers.relay import Relay, Target, retry_db
from workers.sandbox import Sandbox
from workers.supervise import Ask, drain_reason
from workers.workspace import workspace_args

log = logging.getLogger(__name__)


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


def uses_own_code(spec: JobSpec) -> bool:
    """The spec runs users' code: a workspace (its model, its data source, its requirements) or
    requirements of its own (a package runs code as it installs and imports)."""
    return bool(spec.workspace or spec.requirements)


def job_sandbox(settings: Settings, spec: JobSpec, *, workdir: Path, network: bool = False) -> Sandbox:
    """The sandbox of a job's (or a gang node's) trainer: its folder read-write, its workspace
    read-only (the folder workers/workspace.py unpacks it to)."""
    ws = workdir / "workspace"
    return Sandbox(
        settings=settings,
        read_write=[workdir],
        read_only=[ws] if spec.workspace else [],
        network=network,
        user_code=uses_own_code(spec),
    )


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
        doc, world_size, applied_step = job.spec, job.world_size, job.applied_step
        used_s = job.run_seconds or 0.0

    workdir = settings.data_dir / "jobs" / str(job_id)
    # a one-process job takes this pool process's sandboxed trainer made ahead (workers/spare.py):
    # its folder becomes the job's before anything is written there; the next is started now
    # where the run leaves the cores idle (a GPU's), else when it has ended
    spec = stored_job(doc)
    used = spare.take(
        settings,
        workdir,
        fits=world_size == 1 and not spec.requirements,
        start_next=spare.ahead(settings, gpus=spec.gpus, device=spec.resources.device),
    )
    try:
        return _run_job(
            settings,
            attempt,
            workdir,
            used,
            doc=doc,
            spec=spec,
            world_size=world_size,
            applied_step=applied_step,
            used_s=used_s,
        )
    finally:
        spare.replenish(settings, used)


def _run_job(
    settings: Settings,
    attempt: Attempt,
    workdir: Path,
    used: spare.Spare | None,
    *,
    doc: dict[str, Any],
    spec: JobSpec,
    world_size: int,
    applied_step: int | None,
    used_s: float,
) -> str:
    job_id = attempt.job_id
    ckpt_dir = workdir / "checkpoints"
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    # the folder is an earlier attempt's trainer's too: a fresh file, never through a link it left
    write_fresh(spec_path, json.dumps(doc, indent=2), root=workdir)
    target = Target(attempt=attempt, channels=(job_channel(job_id),), run_base=used_s, checkpoints=ckpt_dir)
    relay = Relay(
        settings,
        targets={None: target},
        on_fenced=lambda _key: None,  # the poll below sees relay.fenced and kills the trainer
    )
    run = AttemptRun(
        settings=settings,
        relay=relay,
        folder=workdir,
        what=f"job {job_id} attempt {attempt.attempt}",
        memory_limit=memory_limit_bytes(spec),
        sandbox=job_sandbox(settings, spec, workdir=workdir),
        spare=used,
    )
    cmd = trainer_command(
        world_size=world_size, spec_path=spec_path, ckpt_dir=ckpt_dir, stop_file=run.stop_file
    )

    def fetch() -> Uploader | None:
        uploader = restore_checkpoints(
            settings,
            ckpt_dir=ckpt_dir,
            job_id=job_id,
            applied_step=applied_step,
            relay=relay,
            parallel=spec.parallel,
        )
        cmd.extend(workspace_args(spec, settings=settings, workdir=workdir))
        return uploader

    failure = run.restore(fetch)
    if failure is not None:
        return fail_unstarted(settings, attempt=attempt, relay=relay, error=failure)
    publish_status(relay, job_id=job_id)

    # the limit counts every attempt: the time earlier attempts ran is already used up
    runtime_s = runtime_limit_s(spec, service_max_s=settings.max_job_runtime_s)
    out = run.out

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

    run.prepare(pyenv.for_job(spec, settings=settings, workdir=workdir, relay=relay, job_id=job_id))
    rc = OneTarget(run, torchrun=world_size > 1).launch(cmd, poll=poll)
    if not run.settle(final_upload=lambda: not relay.fenced) or relay.fenced:
        return "lost"
    # the job's end frees its reservation; the scheduler places the next queued job
    status = end_attempt(settings, attempt=attempt, rc=rc, run=run)
    relay.drain_live()
    prune_at_end(settings, attempt=attempt, ckpt_dir=ckpt_dir, mirrors=run.mirrors)
    return status


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


def end_attempt(settings: Settings, *, attempt: Attempt, rc: int, run: AttemptRun) -> str:
    """Every line is applied: write the attempt's end (fenced), or give the job back. A trainer
    process killed by a signal its worker did not send (the OOM killer, a kill -9) is the
    infrastructure's failure: the job goes back to the queue up to its max_restarts
    (workers/failures.py)."""
    job_id, out, relay = attempt.job_id, run.out, run.relay
    oom = run.oom()
    infra = None
    if rc != 0 and out.stopped is None and oom is None:
        infra = infrastructure_failure(rc=rc, stderr="\n".join(out.stderr_tail), oom_before=run.oom_before)

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
                    else f"{drain_reason()}; resumes from its checkpoint"
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
            # a run that succeeded is judged on its whole loss series: flagged when it diverged
            eid = finish_job(s, attempt=attempt, status=status, error=error, judge=judge)
            if eid is None:
                return "lost"
            publish_status(relay, job_id=job_id)
            return str(status)

    return retry_db(settings, "final status", decide)
