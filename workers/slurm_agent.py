"""A Slurm job's node agent: `python -m workers.slurm_agent --job <id>`, started by srun inside the
allocation, one per node (core/slurm.py sbatch_command; docs/slurm.md).

It runs the attempt the way a Celery worker does, through the same functions: `execute_job` (one
node), `execute_gang_node` (node rank = SLURM_NODEID of SLURM_NNODES; node 0, the allocation's
first node, hosts the rendezvous) or `execute_selection` (a selection group), as the pool's node
the scheduler reserved for this node rank (`slurm:<pool>:<i>`): the claim, the lease, the relay,
the checkpoints and the end are theirs.

Slurm's signals: SIGUSR1 (`--signal=USR1@<s>`, the time limit is near) and SIGTERM (scancel, a
requeue, a preemption; SIGKILL follows after KillWait) set `DRAIN`, as a Celery worker's warm
shutdown does: the trainer checkpoints and stops, and the job goes back to the queue (or ends
`cancelled` when its cancel was asked). Slurm signals every process of the job step, the trainer
too, whose default action for both is to die: the agent blocks them before it starts anything, so
the processes it starts inherit the block, and takes them with sigwait on a thread of its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from sqlalchemy import select

from core.settings import Settings, get_settings
from core.slurm import is_pool_node
from db.connection import session_for
from db.ingest import add_event
from db.models import TERMINAL, Job, Reservation
from workers import cores

log = logging.getLogger("workers.slurm_agent")

STOP_SIGNALS = {signal.SIGTERM, signal.SIGUSR1}
FIND_S = 60.0
"""How long an agent waits for its node's reservation (the scheduler places a job given back
by a requeue again within a tick or two)."""


@dataclass(frozen=True, slots=True)
class Placement:
    worker: str
    nnodes: int
    reservation_id: int
    trial_ids: list[int] | None
    selection_id: int | None


def find_placement(
    settings: Settings, *, job_id: int, node_rank: int, wait_s: float = FIND_S
) -> Placement | None:
    """This node's reservation of the job; None when the job ended or none comes within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        with session_for(settings.database_url) as s:
            job = s.execute(select(Job.status, Job.selection_id).where(Job.id == job_id)).first()
            if job is None or job.status in TERMINAL:
                return None
            r = s.scalars(
                select(Reservation).where(Reservation.job_id == job_id, Reservation.node_rank == node_rank)
            ).first()
            if r is not None and is_pool_node(r.worker):  # never a worker's placement
                trials = list(r.trial_ids) if r.trial_ids is not None else None
                return Placement(r.worker, r.nnodes, r.id, trials, job.selection_id)
        if time.monotonic() > deadline:
            return None
        time.sleep(1.0)


def node_address() -> str:
    """This node's address as Slurm knows it (its NodeAddr), for the gang's rendezvous; '' when
    scontrol does not say."""
    name = os.environ.get("SLURMD_NODENAME", "")
    if not name:
        return ""
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "node", name], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    fields = dict(p.split("=", 1) for p in out.split() if "=" in p)
    return fields.get("NodeAddr", "")


def take_stop_signals(settings: Settings, job_id: int) -> None:
    """Block Slurm's stop signals in this process and everything it starts; a thread takes them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def wait() -> None:
        while True:
            sig = signal.sigwait(STOP_SIGNALS)
            why = (
                "slurm: the time limit is near (SIGUSR1)"
                if sig == signal.SIGUSR1
                else "slurm is stopping the allocation (SIGTERM: scancel, requeue or preemption)"
            )
            log.warning("%s: checkpointing and giving the job back", why)
            from workers.supervise import drain

            drain(why)
            try:
                with session_for(settings.database_url) as s:
                    add_event(
                        s,
                        job_id=job_id,
                        kind="log",
                        message=f"{why}; the node agent checkpoints and gives the job back",
                        data={"slurm_job_id": _slurm_id(), "signal": signal.Signals(sig).name},
                    )
            except Exception:  # noqa: BLE001 - the drain goes on without its note
                log.exception("could not record the signal")

    threading.Thread(target=wait, daemon=True, name="slurm-signals").start()


def _slurm_id() -> int | None:
    raw = os.environ.get("SLURM_JOB_ID", "")
    return int(raw) if raw.isdigit() else None


def run(job_id: int, settings: Settings) -> str:
    # the attempt's modules are imported here, after main blocked the stop signals: a thread one
    # of them started before the block would take a stop signal and die of it
    from workers.execute import execute_job
    from workers.gang import execute_gang_node
    from workers.selection import execute_selection

    node_rank = int(os.environ.get("SLURM_NODEID", "0"))
    nnodes = int(os.environ.get("SLURM_NNODES", "1"))
    node = os.environ.get("SLURMD_NODENAME", "?")
    if not settings.node_addr and (addr := node_address()):
        settings = settings.model_copy(update={"node_addr": addr})
    place = find_placement(settings, job_id=job_id, node_rank=node_rank)
    if place is None:
        log.warning(
            "job %s: no reservation of node %d (the job ended or was placed elsewhere)", job_id, node_rank
        )
        return "skipped"
    if place.trial_ids is None and place.nnodes != nnodes:
        log.error("job %s: reserved on %d node(s), the allocation has %d", job_id, place.nnodes, nnodes)
        return "skipped"
    if node_rank == 0:
        with session_for(settings.database_url) as s:
            add_event(
                s,
                job_id=job_id,
                kind="log",
                message=f"slurm job {_slurm_id()} started on {os.environ.get('SLURM_JOB_NODELIST', node)}",
                data={"slurm_job_id": _slurm_id(), "nodes": os.environ.get("SLURM_JOB_NODELIST", node)},
            )
    log.info("job %s: node %d/%d on %s as %s", job_id, node_rank, nnodes, node, place.worker)
    if place.trial_ids is not None and place.selection_id is not None:
        return execute_selection(
            place.selection_id,
            place.trial_ids,
            settings=settings,
            worker=place.worker,
            reservation_id=place.reservation_id,
        )
    if place.nnodes > 1:
        return execute_gang_node(
            job_id, node_rank=node_rank, nnodes=place.nnodes, settings=settings, worker=place.worker
        )
    return execute_job(job_id, settings=settings, worker=place.worker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.slurm_agent", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--job", type=int, required=True, help="the Shardyard job id (a group's first trial's job)"
    )
    args = parser.parse_args(argv)
    settings = get_settings()
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if cpus.isdigit() and int(cpus) >= 1:  # the run keeps to the CPUs Slurm gave it (workers/cores.py)
        cores.set_share(int(cpus))
    # before any thread or process starts: they inherit the block
    take_stop_signals(settings, args.job)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    status = run(args.job, settings)
    log.info("job %s: %s", args.job, status)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
