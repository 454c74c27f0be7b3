"""Runs one job: claim it, launch the trainer in a subprocess, relay its output, end it.

Plain functions, tested without Celery; workers/tasks.py only wraps them. The trainer runs in a
child process (torchrun when it needs several ranks) because a Celery prefork worker must not fork
CUDA or process groups itself.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.broker import send_run_job
from core.settings import Settings
from db.engine import session_for
from db.jobs import cancel_requested, claim_job, finish_job, get_job, live_workers, requeue_job
from db.models import JobStatus
from db.quotas import quota_gate, waiting_jobs
from workers.limits import apply_memory_limit, memory_limit_bytes, out_of_memory_error, runtime_limit_s
from workers.relay import Relay

log = logging.getLogger(__name__)


def trainer_command(*, world_size: int, spec_path: Path, ckpt_dir: Path, stop_file: Path) -> list[str]:
    args = [
        "-m",
        "trainer",
        "--spec",
        str(spec_path),
        "--checkpoint-dir",
        str(ckpt_dir),
        "--stop-file",
        str(stop_file),
    ]
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
        *args,
    ]


@dataclass(slots=True)
class Outcome:
    result: dict[str, Any] | None = None
    error: str | None = None
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=30))


def _pump_stdout(proc: subprocess.Popen[str], relay: Relay, out: Outcome) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.strip()
        if not line:
            continue
        try:
            msg = json.loads(line)
            kind = msg["kind"]
        except (ValueError, KeyError, TypeError):
            relay.event(kind="log", message=line[:2000])
            continue
        at = msg.get("time")
        if kind == "metric":
            relay.metric(int(msg["step"]), str(msg["name"]), float(msg["value"]), at or time.time())
        elif kind == "log":
            relay.event(kind="log", message=str(msg["message"]), at=at)
        elif kind == "event":
            relay.event(kind="event", message=str(msg["event"]), data=msg.get("data"), at=at)
        elif kind == "result":
            out.result = msg.get("data") or {}
        elif kind == "error" and out.error is None:
            out.error = str(msg["message"])


def _pump_stderr(proc: subprocess.Popen[str], path: Path, out: Outcome) -> None:
    assert proc.stderr is not None
    with path.open("a") as f:
        for line in proc.stderr:
            f.write(line)
            out.stderr_tail.append(line.rstrip())


def _die_with_parent() -> None:
    """In the child before exec: own session (so a cancel can kill torchrun and its ranks as one
    group), and SIGKILL when the worker process that launched it dies (Linux), so a killed worker
    never leaves a trainer running unsupervised; the job is then re-queued by the reconciler."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def kill_group(proc: subprocess.Popen[str], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _watch_cancel(
    proc: subprocess.Popen[str],
    *,
    settings: Settings,
    job_id: int,
    stop_file: Path,
    done: threading.Event,
    max_runtime_s: float | None = None,
    out: Outcome | None = None,
) -> None:
    """Poll the cancel flag; ask the trainer to stop at its next step; kill it after the grace.
    Past `max_runtime_s` the trainer is killed and the job fails saying so."""
    asked_at: float | None = None
    deadline = time.monotonic() + max_runtime_s if max_runtime_s else None
    while not done.wait(0.5):
        if deadline is not None and time.monotonic() > deadline:
            if out is not None:
                out.error = f"ran past its max_runtime_s ({max_runtime_s:g} s) and was stopped"
            kill_group(proc, signal.SIGTERM)
            if not done.wait(10):
                kill_group(proc, signal.SIGKILL)
            return
        if asked_at is None:
            try:
                with session_for(settings.database_url) as s:
                    if cancel_requested(s, job_id=job_id):
                        stop_file.touch()
                        asked_at = time.monotonic()
            except Exception:  # noqa: BLE001 - a locked db this tick is fine; try again
                log.exception("cancel poll failed")
        elif time.monotonic() - asked_at > settings.cancel_grace_s:
            kill_group(proc, signal.SIGTERM)
            if done.wait(10):
                return
            kill_group(proc, signal.SIGKILL)
            return


def supervise(
    cmd: list[str],
    *,
    out: Outcome,
    stderr_log: Path,
    pump: Callable[[subprocess.Popen[str]], None],
    watch: Callable[[subprocess.Popen[str], threading.Event], None],
    memory_limit: int | None = None,
) -> int:
    """Run a trainer process to its end: `pump` reads its stdout here, its stderr goes to
    `stderr_log` (the tail kept in `out`), and `watch` (cancel and stop requests) runs in a thread
    until the process is gone. Returns the exit code; the process never outlives this call.
    `memory_limit`: the process's address-space limit (workers/limits.py)."""

    def preexec() -> None:
        _die_with_parent()
        apply_memory_limit(memory_limit)

    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=preexec,  # noqa: PLW1509 - only setsid, prctl and setrlimit, no locks taken
    )
    done = threading.Event()
    threads = [
        threading.Thread(target=_pump_stderr, args=(proc, stderr_log, out), daemon=True),
        threading.Thread(target=watch, args=(proc, done), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        pump(proc)
        return proc.wait()
    finally:
        done.set()
        if proc.poll() is None:
            kill_group(proc, signal.SIGKILL)
            proc.wait()
        for t in threads:
            t.join(timeout=5)


def _reclaim_orphan(settings: Settings, job_id: int) -> None:
    """A redelivered message for a job left `running` by a dead worker: put it back in the queue."""
    with session_for(settings.database_url) as s:
        job = get_job(s, job_id)
        if job.status != JobStatus.running:
            return
        alive = {w.name for w in live_workers(s, within_s=settings.orphan_after_s)}
        if job.worker not in alive:
            requeue_job(s, job_id=job_id, reason=f"worker {job.worker} is gone")


def execute_job(job_id: int, *, settings: Settings, worker: str) -> str:
    """Run job `job_id` to its end. Returns the final status, or 'skipped' when another delivery
    of the same message already has it."""
    _reclaim_orphan(settings, job_id)
    with session_for(settings.database_url) as s:
        # the owner's quota is checked and the claim made in one transaction (db/quotas.py); a job
        # over it stays queued with the reason and is sent again when one of theirs ends
        if quota_gate(s, job_id=job_id, defaults=settings.quota_defaults) is not None:
            return "waiting"
        if not claim_job(s, job_id=job_id, worker=worker):
            return "skipped"
        job = get_job(s, job_id)
        spec, world_size, owner_id = job.spec, job.world_size, job.owner_id

    workdir = settings.data_dir / "jobs" / str(job_id)
    ckpt_dir = workdir / "checkpoints"
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    stop_file = workdir / "stop"
    stop_file.unlink(missing_ok=True)

    relay = Relay(settings, job_id=job_id)
    relay.event(kind="status", message="running", data={"worker": worker})
    cmd = trainer_command(world_size=world_size, spec_path=spec_path, ckpt_dir=ckpt_dir, stop_file=stop_file)
    relay.event(kind="log", message=f"{worker}: {' '.join(cmd[1:])}")
    out = Outcome()
    mem_limit = memory_limit_bytes(spec)
    rc = supervise(
        cmd,
        out=out,
        stderr_log=workdir / "stderr.log",
        pump=lambda proc: _pump_stdout(proc, relay, out),
        watch=lambda proc, done: _watch_cancel(
            proc,
            settings=settings,
            job_id=job_id,
            stop_file=stop_file,
            done=done,
            max_runtime_s=runtime_limit_s(spec, service_max_s=settings.max_job_runtime_s),
            out=out,
        ),
        memory_limit=mem_limit,
    )

    with session_for(settings.database_url) as s:
        cancelled = cancel_requested(s, job_id=job_id)
    if cancelled:
        status, error = JobStatus.cancelled, None
    elif rc == 0 and out.result is not None:
        status, error = JobStatus.succeeded, None
    else:
        status = JobStatus.failed
        tail = "\n".join(list(out.stderr_tail)[-5:])
        error = out_of_memory_error(error=out.error, stderr_tail=list(out.stderr_tail), limit=mem_limit)
        error = error or out.error or f"trainer exited with code {rc}" + (f": {tail}" if tail else "")
    with session_for(settings.database_url) as s:
        finish_job(s, job_id=job_id, status=status, error=error, result=out.result)
    relay.event(kind="status", message=str(status), data={"error": error})
    relay.close()
    if owner_id is not None:
        _send_waiting(settings, owner_id)
    return str(status)


def _send_waiting(settings: Settings, owner_id: int) -> None:
    """A job of this owner ended: their jobs held back by the quota get another try."""
    with session_for(settings.database_url) as s:
        for waiting_id, queue in waiting_jobs(s, owner_id=owner_id):
            send_run_job(settings, job_id=waiting_id, queue=queue)
