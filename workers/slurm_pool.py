"""The submitter of the Slurm pools (`python -m workers.slurm_pool`): one process per deployment, on a
host with the Slurm client commands and the database (docs/slurm.md).

Every `poll_s` it
1. writes a heartbeat for each node of each pool (`slurm:<pool>:<i>`, core/slurm.py), so the
   scheduler reserves a pool's nodes as it reserves a worker's slots (its task is never sent:
   core/scheduler.py leaves a pool's reservations to this loop);
2. reads its Slurm jobs (`squeue`, by the pool's job name prefix) and the database;
3. submits one Slurm job (`sbatch`, core/slurm.py sbatch_command) for each job reserved in a pool
   that has none, and records its Slurm job id in the job's events;
4. shows a pending Slurm job's reason (`squeue %r`) as the job's wait reason;
5. cancels (`scancel`) the Slurm job of a job that ended or whose cancel was asked;
6. gives back a running job whose Slurm job vanished (its node agents are gone): to the queue,
   counted against its max_restarts, with the reason Slurm gives (`scontrol show job`); a job whose
   Slurm job ended before any agent claimed it is submitted again, `submit_tries` times at most;
7. takes back the leases that ran out (workers/tasks.py reconcile_once), as every Celery worker
   does: a pool may be the only launcher there is.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from core.settings import Settings, get_settings
from core.slurm import (
    SQUEUE_FORMAT,
    SlurmJob,
    SlurmPool,
    SlurmSettings,
    is_pool_node,
    parse_squeue,
    pending_reason,
    pool_of,
    sbatch_command,
    sizing,
)
from db import scheduling as dbs
from db.connection import session_for
from db.gangs import give_back_gang
from db.ingest import add_event
from db.jobs import Attempt, fail_job, restart_job
from db.models import TERMINAL, Job, JobStatus
from db.workers import record_heartbeat
from jobrules.restarts import max_restarts
from jobrules.spec import stored_job

log = logging.getLogger(__name__)

CMD_TIMEOUT_S = 30.0


class SlurmUnavailable(RuntimeError):
    """A Slurm command failed or did not answer (the controller is down): the tick is skipped."""


def slurm(args: list[str], *, stdin: str | None = None) -> str:
    """Run one Slurm client command; its stdout, or SlurmUnavailable with its stderr."""
    try:
        got = subprocess.run(
            args, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmUnavailable(f"{args[0]}: {e}") from e
    if got.returncode != 0:
        raise SlurmUnavailable(
            f"{args[0]} exited {got.returncode}: {got.stderr.strip() or got.stdout.strip()}"
        )
    return got.stdout


def slurm_job_state(slurm_id: int) -> str:
    """How Slurm says a job of its ended ('NODE_FAIL (reason: ...)'), while it still knows it
    (MinJobAge); '' when it does not."""
    try:
        out = slurm(["scontrol", "-o", "show", "job", str(slurm_id)])
    except SlurmUnavailable:
        return ""
    fields = dict(p.split("=", 1) for p in out.split() if "=" in p)
    state, reason = fields.get("JobState", ""), fields.get("Reason", "None")
    return f"{state} (reason: {reason})" if reason not in ("", "None") else state


@dataclass(slots=True)
class Known:
    """What this process remembers of one job's Slurm jobs."""

    slurm_id: int | None = None
    submits: int = 0
    """Slurm jobs submitted in a row that ended before an agent claimed the job."""
    attempts: int = 0
    """The job's attempts when its Slurm job was submitted: more later, an agent claimed it."""
    gone_ticks: int = 0
    refused_at: float = 0.0
    cancelled: set[int] = field(default_factory=set)


@dataclass(slots=True)
class JobRow:
    id: int
    status: str
    cancel_requested: bool
    attempts: int
    owner: str | None
    worker: str | None
    wait_reason: str | None
    priority: int
    nnodes: int | None
    spec: dict[str, Any]
    kind: str


class Submitter:
    def __init__(self, settings: Settings, slurm_settings: SlurmSettings) -> None:
        self.settings = settings
        self.conf = slurm_settings
        self.pools = {p.name: p for p in slurm_settings.pools}
        self.known: dict[int, Known] = {}
        self.last_beat = 0.0
        self.last_reconcile = 0.0
        self.stop_event = threading.Event()

    # ---- 1. heartbeats ---------------------------------------------------------------------------

    def beat(self) -> None:
        with session_for(self.settings.database_url) as s:
            for pool in self.pools.values():
                ram = pool.mem_per_node_mb * 2**20 if pool.mem_per_node_mb else 2**50
                devices = [{"type": "cuda", "index": i} for i in range(pool.gpus_per_node)] or [
                    {"type": "cpu"}
                ]
                for name in pool.node_names:
                    record_heartbeat(
                        s,
                        name=name,
                        hostname=socket.gethostname(),
                        queues=pool.queues(),
                        devices=devices,
                        host={
                            "slots": pool.slots_per_node,
                            "tasks": pool.slots_per_node,
                            "ram_bytes": ram,
                            "cpus": pool.slots_per_node,
                            "slurm_pool": 1,
                        },
                    )
            s.commit()

    # ---- 2. what Slurm and the database say ------------------------------------------------------

    def squeue(self, pool: SlurmPool) -> dict[int, SlurmJob]:
        # every job the controller knows that has not ended (pending, running, completing,
        # requeued); parse_squeue keeps the pool's own, by their names
        args = ["squeue", "-h", "-o", SQUEUE_FORMAT]
        if pool.partition:
            args.append(f"--partition={pool.partition}")
        return parse_squeue(pool, slurm(args))

    def jobs(self, s: Any, ids: set[int]) -> dict[int, JobRow]:
        if not ids:
            return {}
        q = select(
            Job.id,
            Job.status,
            Job.cancel_requested,
            Job.attempts,
            Job.owner,
            Job.worker,
            Job.wait_reason,
            Job.priority,
            Job.nnodes,
            Job.spec,
            Job.kind,
        ).where(Job.id.in_(sorted(ids)))
        return {r.id: JobRow(*r) for r in s.execute(q)}

    def running_in_pools(self, s: Any) -> set[int]:
        q = select(Job.id).where(Job.status == JobStatus.running, Job.worker.like("slurm:%"))
        return set(s.scalars(q))

    # ---- one tick --------------------------------------------------------------------------------

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last_beat >= min(self.settings.heartbeat_s, self.conf.poll_s * 5):
            self.beat()
            self.last_beat = now
        slurm_jobs: dict[str, dict[int, SlurmJob]] = {}
        for pool in self.pools.values():
            slurm_jobs[pool.name] = self.squeue(pool)  # SlurmUnavailable: the whole tick waits
        with session_for(self.settings.database_url) as s:
            held = [h for h in dbs.reservations(s) if pool_of(h.worker) in self.pools]
            by_job: dict[int, list[dbs.HeldRow]] = {}
            for h in held:
                by_job.setdefault(h.job_id, []).append(h)
            ids = set(by_job) | self.running_in_pools(s)
            for of_pool in slurm_jobs.values():
                ids |= set(of_pool)
            rows = self.jobs(s, ids)
            s.commit()
        for job_id, nodes in by_job.items():
            pool = self.pools[pool_of(nodes[0].worker) or ""]
            row = rows.get(job_id)
            if row is not None:
                self.placed(
                    pool, row, sorted(nodes, key=lambda n: n.node_rank), slurm_jobs[pool.name].get(job_id)
                )
        for pool in self.pools.values():
            for job_id, sj in slurm_jobs[pool.name].items():
                row = rows.get(job_id)
                # a selection group's Slurm job is named for its first trial, which may end before
                # the group does: the group's reservation going (its end) ends it
                if row is not None and row.kind == "trial" and job_id in by_job:
                    continue
                self.maybe_cancel(sj, row)
        for job_id, row in rows.items():
            # a lost selection group comes back through its trials' leases (the reconciler)
            if row.kind != "job":
                continue
            if row.status == JobStatus.running and pool_of(row.worker or "") in self.pools:
                pool = self.pools[pool_of(row.worker or "") or ""]
                self.maybe_vanished(pool, row, slurm_jobs[pool.name].get(job_id))
        # forget the jobs that have nothing left in a pool (ended, deleted, placed elsewhere)
        self.known = {k: v for k, v in self.known.items() if k in ids}
        if now - self.last_reconcile >= self.settings.reconcile_s:
            self.last_reconcile = now
            from workers.tasks import reconcile_once  # the Celery app's module: only when needed

            reconcile_once()

    # ---- 3, 4: a placed job ----------------------------------------------------------------------

    def placed(self, pool: SlurmPool, row: JobRow, nodes: list[dbs.HeldRow], sj: SlurmJob | None) -> None:
        known = self.known.setdefault(row.id, Known())
        if row.status != JobStatus.queued or row.cancel_requested or any(n.claimed for n in nodes):
            return
        if sj is not None:
            # queued under it: no agent of it has claimed the job (yet, or again after a requeue)
            known.slurm_id, known.gone_ticks, known.attempts = sj.slurm_id, 0, row.attempts
            if sj.state == "PENDING":
                why = pending_reason(sj, pool)
                if why != row.wait_reason:
                    with session_for(self.settings.database_url) as s:
                        dbs.set_wait_reasons(s, {row.id: why})
            return
        if known.slurm_id is not None and row.attempts > known.attempts:
            # its Slurm job ran the job and gave it back (the time limit's signal): a new one
            known.slurm_id, known.submits, known.gone_ticks = None, 0, 0
        elif known.slurm_id is not None:
            # its Slurm job ended before any agent claimed the job: submitted again, a few times
            known.gone_ticks += 1
            if known.gone_ticks < 2:
                return
            state = slurm_job_state(known.slurm_id)
            if known.submits >= self.conf.submit_tries:
                why = (
                    f"slurm job {known.slurm_id} ended ({state or 'gone'}) before its node agents "
                    f"started the job, {known.submits} time(s); see its output in "
                    f"{self.output_path(row.id)}"
                )
                with session_for(self.settings.database_url) as s:
                    try:
                        fail_job(s, job_id=row.id, reason=why, actor="slurm pool")
                    except Exception as e:  # noqa: BLE001 - ended meanwhile
                        log.info("job %s: %s", row.id, e)
                return
            with session_for(self.settings.database_url) as s:
                add_event(
                    s,
                    job_id=row.id,
                    kind="log",
                    message=f"slurm job {known.slurm_id} ended ({state or 'gone'}) before it started the job; submitted again",
                )
            known.slurm_id = None
        if time.monotonic() - known.refused_at < self.conf.sbatch_retry_s and known.refused_at:
            return
        self.submit(pool, row, nodes, known)

    def output_path(self, job_id: int) -> str:
        return str(self.settings.data_dir / "slurm" / f"job-{job_id}-%j.out")

    def submit(self, pool: SlurmPool, row: JobRow, nodes: list[dbs.HeldRow], known: Known) -> None:
        first = nodes[0]
        size = sizing(
            pool,
            nnodes=first.nnodes,
            slots=first.slots,
            gpus=first.gpus,
            ram_bytes=first.ram_bytes,
            max_runtime_s=stored_job(row.spec).max_runtime_s,
        )
        (self.settings.data_dir / "slurm").mkdir(parents=True, exist_ok=True)
        args, script = sbatch_command(
            pool, job_id=row.id, size=size, priority=row.priority, output=self.output_path(row.id)
        )
        try:
            out = slurm(args, stdin=script)
        except SlurmUnavailable as e:
            known.refused_at = time.monotonic()
            why = f"sbatch refused it (tried again every {self.conf.sbatch_retry_s:g} s): {e}"
            log.warning("job %s: %s", row.id, why)
            with session_for(self.settings.database_url) as s:
                if why != row.wait_reason:
                    dbs.set_wait_reasons(s, {row.id: why})
            return
        slurm_id = int(out.strip().split(";")[0])
        known.attempts = row.attempts
        known.slurm_id, known.submits, known.gone_ticks, known.refused_at = (
            slurm_id,
            known.submits + 1,
            0,
            0.0,
        )
        where = f" in partition {pool.partition}" if pool.partition else ""
        msg = (
            f"slurm job {slurm_id} submitted{where}: {size.nodes} node(s) x {size.tasks_per_node} task(s)"
            + (f", gpu:{size.gpus_per_node}" if size.gpus_per_node else "")
            + f", {size.mem_mb} MiB, {size.minutes} min"
        )
        log.info("job %s: %s", row.id, msg)
        with session_for(self.settings.database_url) as s:
            add_event(
                s,
                job_id=row.id,
                kind="log",
                message=msg,
                data={"slurm_job_id": slurm_id, "pool": pool.name, "nodes": size.nodes},
            )
            dbs.set_wait_reasons(s, {row.id: f"slurm job {slurm_id} submitted"})

    # ---- 5: cancel -------------------------------------------------------------------------------

    def maybe_cancel(self, sj: SlurmJob, row: JobRow | None) -> None:
        # kept while the job may still be its: not ended, no cancel asked, not running elsewhere
        elsewhere = row is not None and row.status == JobStatus.running and not is_pool_node(row.worker)
        if row is not None and row.status not in TERMINAL and not row.cancel_requested and not elsewhere:
            return
        known = self.known.setdefault(sj.job_id, Known())
        if sj.slurm_id in known.cancelled:
            return
        try:
            slurm(["scancel", str(sj.slurm_id)])
        except SlurmUnavailable as e:
            log.warning("job %s: scancel %s failed: %s", sj.job_id, sj.slurm_id, e)
            return
        known.cancelled.add(sj.slurm_id)
        why = "deleted" if row is None else ("cancel requested" if row.cancel_requested else str(row.status))
        if elsewhere and row is not None:
            why = f"running on {row.worker}"
        log.info("job %s (%s): scancel %s", sj.job_id, why, sj.slurm_id)
        if row is not None:
            with session_for(self.settings.database_url) as s:
                add_event(
                    s,
                    job_id=row.id,
                    kind="log",
                    message=f"slurm job {sj.slurm_id} cancelled (scancel): the job is {why}",
                    data={"slurm_job_id": sj.slurm_id},
                )

    # ---- 6: a running job whose Slurm job vanished -----------------------------------------------

    def maybe_vanished(self, pool: SlurmPool, row: JobRow, sj: SlurmJob | None) -> None:
        known = self.known.setdefault(row.id, Known())
        if sj is not None:
            known.slurm_id, known.gone_ticks = sj.slurm_id, 0
            return
        # squeue was read before the database: an agent that ended the job wrote its end before
        # its Slurm job ended, so a job still running here has lost its agents. Twice, to be sure.
        known.gone_ticks += 1
        if known.gone_ticks < 2:
            return
        state = slurm_job_state(known.slurm_id) if known.slurm_id is not None else ""
        sid = f"slurm job {known.slurm_id}" if known.slurm_id is not None else "its slurm job"
        why = (
            f"{sid} vanished ({state or 'no longer in squeue'}) while it ran the job (attempt {row.attempts})"
        )
        log.warning("job %s: %s", row.id, why)
        with session_for(self.settings.database_url) as s:
            if (row.nnodes or 1) > 1:
                got = give_back_gang(
                    s,
                    job_id=row.id,
                    attempt=row.attempts,
                    reason=why,
                    restart=True,
                    gang_restarts=self.settings.gang_restarts,
                )
            elif row.owner is not None:
                attempt = Attempt(job_id=row.id, attempt=row.attempts, owner=row.owner)
                got = restart_job(s, attempt=attempt, reason=why, max_restarts=max_restarts(row.spec))
            else:
                got = None
        known.gone_ticks, known.slurm_id = 0, None
        log.info("job %s: %s", row.id, got)

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> None:
        log.info("slurm pools: %s", ", ".join(f"{p.name} ({p.nodes} node(s))" for p in self.pools.values()))
        while not self.stop_event.is_set():
            try:
                self.tick()
            except SlurmUnavailable as e:
                log.warning("slurm: %s", e)
            except Exception:  # noqa: BLE001 - keep submitting
                log.exception("slurm pool tick failed")
            self.stop_event.wait(self.conf.poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.slurm_pool", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    conf = SlurmSettings()
    if not conf.pools:
        log.error("no Slurm pool: set SHARDYARD_SLURM_POOLS (docs/slurm.md)")
        return 2
    sub = Submitter(get_settings(), conf)
    signal.signal(signal.SIGTERM, lambda *_: sub.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: sub.stop_event.set())
    sub.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
