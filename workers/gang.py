"""Runs one node of a job wider than one worker (a gang): the scheduler reserved N workers at once
and sent each a `shardyard.run_job` task with its node_rank and nnodes.

- Node 0 takes the job's lease (as a one-node job does), picks a free port on its reachable
  address and writes "host:port" on its reservation; the other nodes claim their own reservation
  for the same attempt and wait (at most `gang_join_s`) for that endpoint.
- Every node runs `torchrun --nnodes N --nproc-per-node <its slots> --rdzv-backend c10d
  --rdzv-id <job>-<attempt> --rdzv-endpoint <host:port>` on the same spec and the same
  checkpoint folder path. With the default store (SHARDYARD_STORAGE_URL empty) that folder is the
  data dir, which every node must then share (like Determined's shared_fs); with a folder or S3
  store each node restores every rank's piece from the store into its own data dir before its
  torchrun starts and uploads its own ranks' pieces as they are written (workers/ckpt_sync.py).
- Which node prints the job's lines: torchrun's c10d rendezvous numbers the agents by sorting their
  node descriptors (--local-addr, the agent's pid, a counter; torch/distributed/elastic/rendezvous/
  dynamic_rendezvous.py `_mark_rendezvous_complete`), and global rank 0 is local rank 0 of the agent
  numbered 0 (agent/server/api.py `_assign_worker_ranks`). That is any node, not node 0. So every
  node relays its trainer's stdout, only the node holding rank 0 has lines to write, and each write
  is fenced by the gang's rule (db/gangs.py apply_gang_lines): the job runs this attempt and the
  writer is its owner or holds a live reservation of it. Each metric step reaches the database once.
- The gang ends as one. Whichever node first sees it broken (its trainer failed, e.g. a peer's
  sockets closed) gives the job back (db/gangs.py give_back_gang): its reservations are deleted, so
  every other node is fenced off and kills its trainer at its next poll, and the job goes back to
  `queued` (attempt + 1) to be placed again and resume from its last checkpoint, at most
  `gang_restarts` times, then fails with the reason. A node that dies outright stops renewing its
  lease; the reconciler's expire_leases then gives the gang back the same way.
- torchrun runs with --max-restarts 0: an in-place restart would re-run steps with the protocol's
  sequence numbers starting over (the relay would drop them as already applied) and, with a node
  gone, c10d would wait for a replacement that only the scheduler can provide. The restart goes
  through the database instead.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from core.broker import job_channel
from core.safe_files import write_fresh
from core.settings import Settings
from core.storage import get_storage
from db.connection import session_for
from db.gangs import (
    GangView,
    claim_node,
    gang_view,
    give_back_gang,
    renew_node,
    set_rdzv_endpoint,
    unclaim_node,
)
from db.jobs import Attempt, NotFound, finish_job, get_job
from db.models import JobStatus
from jobrules.divergence import judge
from jobrules.spec import JobSpec, stored_job
from workers import pyenv
from workers.attempt import (
    AttemptRun,
    OneTarget,
    QuotaWait,
    owner_id,
    prune_at_end,
    publish_status,
    restore_checkpoints,
    take_lease,
)
from workers.ckpt_sync import Uploader
from workers.execute import job_sandbox, trainer_args
from workers.failures import JOB_OWN_FAILURES, infrastructure_failure
from workers.limits import memory_limit_bytes, out_of_memory_error, runtime_error, runtime_limit_s
from workers.relay import Relay, Target, retry_db
from workers.supervise import Ask, Outcome, drain_reason
from workers.workspace import workspace_args

log = logging.getLogger(__name__)


def node_addr(settings: Settings) -> str:
    """The address the other nodes reach this worker at."""
    return settings.node_addr or socket.gethostbyname(socket.gethostname())


def free_port(addr: str) -> int:
    # note: the port is free now; torchrun binds it a moment later (a clash fails the attempt,
    # which the gang's restart covers)
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def gang_command(
    *,
    job_id: int,
    attempt: int,
    node_rank: int,
    nnodes: int,
    slots: int,
    endpoint: str,
    addr: str,
    join_s: float,
    trainer_args: list[str],
) -> list[str]:
    """One node's torchrun. Node 0 hosts the c10d rendezvous store on the endpoint (is_host: the
    others must not try to, which they would on one machine where every address is local)."""
    conf = f"is_host={1 if node_rank == 0 else 0},join_timeout={max(int(join_s), 1)}"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(slots),
        "--rdzv-backend",
        "c10d",
        "--rdzv-id",
        f"{job_id}-{attempt}",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-conf",
        conf,
        "--local-addr",
        addr,
        "--max-restarts",
        "0",
        "-m",
        "trainer",
        *trainer_args,
    ]


def _view(settings: Settings, attempt: Attempt, node_rank: int) -> GangView:
    with session_for(settings.database_url) as s:
        return gang_view(s, attempt=attempt, node_rank=node_rank)


def _claim(settings: Settings, *, job_id: int, node_rank: int, worker: str) -> Attempt | None:
    if node_rank == 0:
        attempt = take_lease(settings, job_id=job_id, worker=worker)
        if attempt is None:
            return None
    with session_for(settings.database_url) as s:
        mine = claim_node(
            s, job_id=job_id, node_rank=node_rank, worker=worker, owner=owner_id(), lease_s=settings.lease_s
        )
    if node_rank == 0 and mine != attempt:
        # e.g. a retried task re-claimed the job (attempts + 1) past its placement: the other
        # nodes' reservations name the old attempt, so this placement is given back, uncounted
        why = f"node 0 on {worker}: its reservation does not match attempt {attempt.attempt}; placed again"
        with session_for(settings.database_url) as s:
            give_back_gang(
                s,
                job_id=job_id,
                attempt=attempt.attempt,
                reason=why,
                restart=False,
                gang_restarts=settings.gang_restarts,
                writer=attempt,
            )
        return None
    return mine


def _await_endpoint(settings: Settings, attempt: Attempt, node_rank: int) -> tuple[str | None, str]:
    """A node > 0 waits for node 0's endpoint, renewing its own lease meanwhile. Returns (the
    endpoint, "") or (None, why not)."""
    deadline = time.monotonic() + settings.gang_join_s
    renewed = time.monotonic()
    while time.monotonic() < deadline:
        view = _view(settings, attempt, node_rank)
        if view.endpoint:
            return view.endpoint, ""
        if view.cancel:
            return None, "cancelled"
        if not view.held:
            return None, "the scheduler took the placement back"
        if time.monotonic() - renewed > settings.lease_s / 3:
            with session_for(settings.database_url) as s:
                renew_node(s, attempt=attempt, node_rank=node_rank, lease_s=settings.lease_s)
            renewed = time.monotonic()
        time.sleep(0.5)
    return None, f"waited {settings.gang_join_s:g} s (gang_join_s) for node 0's rendezvous endpoint"


def _rendezvous(
    settings: Settings, *, attempt: Attempt, node_rank: int, worker: str, addr: str
) -> tuple[str | None, str]:
    """Node 0 picks the endpoint and writes it on its reservation; a node > 0 waits for it.
    Returns (the endpoint, "") or (None, this node's outcome: 'lost' or 'waited')."""
    if node_rank == 0:
        endpoint = f"{addr}:{free_port(addr)}"
        with session_for(settings.database_url) as s:
            if not set_rdzv_endpoint(s, attempt=attempt, endpoint=endpoint, lease_s=settings.lease_s):
                return None, "lost"
        return endpoint, ""
    got, why = retry_db(settings, "rendezvous", lambda: _await_endpoint(settings, attempt, node_rank))
    if got is None:
        with session_for(settings.database_url) as s:
            # the scheduler sends the node's task again (a lost or late node 0 message)
            unclaim_node(
                s, attempt=attempt, node_rank=node_rank, reason=f"node {node_rank} on {worker}: {why}"
            )
        return None, "waited"
    return got, ""


def _node_poll(
    settings: Settings,
    *,
    attempt: Attempt,
    node_rank: int,
    worker: str,
    run: AttemptRun,
    runtime_s: float,
    used_s: float,
) -> Callable[[], Ask]:
    """A node's stop poll: killed when fenced off, over its runtime (the gang then fails) or the
    gang is over; stopped (checkpointing) on a cancel or a preemption."""
    relay, out = run.relay, run.out
    target = next(iter(relay.targets.values()))

    def poll() -> Ask:
        if relay.fenced or relay.broken:
            return Ask.kill
        if target.run_seconds() > runtime_s:
            out.error = runtime_error(runtime_s, used_s)
            # failed before any trainer dies: the other nodes then see the gang over, and none
            # of them takes its peers' deaths for a lost node to restart from
            with session_for(settings.database_url) as s:
                give_back_gang(
                    s,
                    job_id=attempt.job_id,
                    attempt=attempt.attempt,
                    reason=f"node {node_rank} on {worker}: {out.error}",
                    restart=False,
                    gang_restarts=settings.gang_restarts,
                    writer=attempt,
                    fail=True,
                )
            return Ask.kill
        view = _view(settings, attempt, node_rank)
        if not view.intact:  # another node gave the gang back, or the reaper did
            return Ask.kill
        return Ask.stop if view.cancel or view.preempt else Ask.none

    return poll


def _node_run(
    settings: Settings, *, attempt: Attempt, node_rank: int, doc: dict[str, Any], spec: JobSpec, used_s: float
) -> AttemptRun:
    """The node's attempt: its folder (`node-<rank>` in the job's) with the spec (`doc` as stored,
    read as `spec`), its relay (its
    writes fenced by the gang's rule) and its sandbox."""
    workdir = settings.data_dir / "jobs" / str(attempt.job_id)
    node_dir = workdir / f"node-{node_rank}"
    ckpt_dir = workdir / "checkpoints"  # one folder for every node: shared storage
    node_dir.mkdir(parents=True, exist_ok=True)
    write_fresh(node_dir / "spec.json", json.dumps(doc, indent=2), root=node_dir)  # never through a link
    target = Target(
        attempt=attempt,
        channels=(job_channel(attempt.job_id),),
        node_rank=node_rank,
        run_base=used_s,
        checkpoints=ckpt_dir,
    )
    relay = Relay(
        settings,
        targets={None: target},
        on_fenced=lambda _key: None,  # the node's poll sees relay.fenced and kills the trainer
    )
    # the node's ranks reach the other nodes' rendezvous and collective ports: the host's network
    sandbox = job_sandbox(settings, spec, workdir=node_dir, network=True)
    sandbox.read_write.append(ckpt_dir)
    return AttemptRun(
        settings=settings,
        relay=relay,
        folder=node_dir,
        what=f"job {attempt.job_id} node {node_rank} attempt {attempt.attempt}",
        memory_limit=memory_limit_bytes(spec),
        sandbox=sandbox,
    )


def _restore_node(
    settings: Settings,
    run: AttemptRun,
    *,
    node_rank: int,
    spec: JobSpec,
    applied_step: int,
    args: list[str],
) -> Uploader | None:
    """The node's checkpoints and workspace before its torchrun (its arguments into `args`).
    With the default store every node shares one folder: node 0 applies the rule there, before
    any rank reads it (the other nodes' ranks cannot start before node 0's torchrun). With another
    store each node restores every piece into its own folder (which ranks it gets is known only
    after the rendezvous) and uploads its own ranks' pieces."""
    uploader = None
    if node_rank == 0 or not get_storage(settings).is_data_dir:
        uploader = restore_checkpoints(
            settings,
            ckpt_dir=run.folder.parent / "checkpoints",
            job_id=run.relay.targets[None].attempt.job_id,
            applied_step=applied_step,
            relay=run.relay,
            parallel=spec.parallel,
        )
    args.extend(workspace_args(spec, settings=settings, workdir=run.folder))
    return uploader


def execute_gang_node(job_id: int, *, node_rank: int, nnodes: int, settings: Settings, worker: str) -> str:
    """Run node `node_rank` of job `job_id` to the gang's end. Returns this node's outcome: the
    job's final status (node 0), 'done' (a node > 0 whose part ended cleanly), 'queued' (the gang
    was given back), 'skipped' (not ours), 'waited' (node 0's endpoint never came) or 'lost'."""
    try:
        attempt = retry_db(
            settings, "claim", lambda: _claim(settings, job_id=job_id, node_rank=node_rank, worker=worker)
        )
    except QuotaWait:
        return "waiting"
    if attempt is None:
        return "skipped"
    addr = node_addr(settings)
    endpoint, outcome = _rendezvous(settings, attempt=attempt, node_rank=node_rank, worker=worker, addr=addr)
    if endpoint is None:
        return outcome

    with session_for(settings.database_url) as s:
        job = get_job(s, job_id)
        doc, applied_step = job.spec, job.applied_step
        used_s = job.run_seconds or 0.0  # node 0 records it (db/gangs.py apply_gang_lines)
    slots = _view(settings, attempt, node_rank).slots
    spec = stored_job(doc)
    run = _node_run(settings, attempt=attempt, node_rank=node_rank, doc=doc, spec=spec, used_s=used_s)
    relay, node_dir = run.relay, run.folder
    ckpt_dir = node_dir.parent / "checkpoints"  # one folder for every node: shared storage
    spec_path = node_dir / "spec.json"
    args = trainer_args(spec_path=spec_path, ckpt_dir=ckpt_dir, stop_file=run.stop_file)
    ender = GangEnd(settings=settings, attempt=attempt, node_rank=node_rank, worker=worker, relay=relay)

    failure = run.restore(
        lambda: _restore_node(
            settings, run, node_rank=node_rank, spec=spec, applied_step=applied_step, args=args
        )
    )
    if failure is not None:
        why = f"node {node_rank} on {worker}: {failure}"
        log.error("job %s: %s", job_id, why)
        status = retry_db(settings, "gang end", lambda: ender.give_back(why, restart=False, fail=True))
        relay.close()
        return status
    cmd = gang_command(
        job_id=job_id,
        attempt=attempt.attempt,
        node_rank=node_rank,
        nnodes=nnodes,
        slots=slots,
        endpoint=endpoint,
        addr=addr,
        join_s=settings.gang_join_s,
        trainer_args=args,
    )
    if node_rank == 0:
        publish_status(relay, job_id=job_id)
    out = run.out
    # the limit counts every attempt, as for a one-node job (workers/execute.py)
    poll = _node_poll(
        settings,
        attempt=attempt,
        node_rank=node_rank,
        worker=worker,
        run=run,
        runtime_s=runtime_limit_s(spec, service_max_s=settings.max_job_runtime_s),
        used_s=used_s,
    )
    log.info("job %s node %d/%d: %s", job_id, node_rank, nnodes, " ".join(cmd))
    # each node builds (or finds) the job's own requirements before its torchrun
    run.prepare(pyenv.for_job(spec, settings=settings, workdir=node_dir, relay=relay, job_id=job_id))
    rc = OneTarget(run, torchrun=True).launch(cmd, poll=poll)

    # once the gang was given back, a newer attempt may already be restoring from the store; but
    # node 0 may have ended the job succeeded (the result was in) while this node's trainer was
    # still exiting: this node's pieces of the last checkpoints are the run's, still to be stored
    def ended_here() -> bool:
        return node_rank > 0 and _succeeded_on(settings, attempt)

    def ours() -> bool:
        if not relay.fenced and _view(settings, attempt, node_rank).intact:
            return True
        if not ended_here():
            return False
        if run.uploader is not None:  # its relay may be fenced off by the job's end: upload still
            run.uploader.allowed = lambda: True
        return True

    if not run.settle(final_upload=ours):
        return "lost"
    if relay.fenced:
        if ended_here():  # its part is stored: it prunes as the node that ends last must
            prune_at_end(settings, attempt=attempt, ckpt_dir=ckpt_dir, mirrors=run.mirrors)
            return "done"
        return "lost"
    status = retry_db(
        settings,
        "gang end",
        lambda: ender.decide(rc=rc, out=out, memory_limit=run.memory_limit, oom_before=run.oom_before),
    )
    # every node prunes its own folder and the store (the one that ends last sees every piece)
    prune_at_end(settings, attempt=attempt, ckpt_dir=ckpt_dir, mirrors=run.mirrors)
    return status


def _succeeded_on(settings: Settings, attempt: Attempt) -> bool:
    """The job ended succeeded on this very attempt (no newer one restores from the store)."""
    with session_for(settings.database_url) as s:
        try:
            job = get_job(s, attempt.job_id)
        except NotFound:
            return False
        return job.status == JobStatus.succeeded and job.attempts == attempt.attempt


class GangEnd:
    """What a node does once its trainer exited and every line it wrote is applied."""

    def __init__(
        self,
        *,
        settings: Settings,
        attempt: Attempt,
        node_rank: int,
        worker: str,
        relay: Relay,
    ) -> None:
        self.settings, self.attempt, self.node_rank, self.worker, self.relay = (
            settings,
            attempt,
            node_rank,
            worker,
            relay,
        )

    def give_back(self, reason: str, *, restart: bool, fail: bool = False) -> str:
        with session_for(self.settings.database_url) as s:
            status = give_back_gang(
                s,
                job_id=self.attempt.job_id,
                attempt=self.attempt.attempt,
                reason=reason,
                restart=restart,
                gang_restarts=self.settings.gang_restarts,
                writer=self.attempt,
                fail=fail,
            )
        if status is None:
            return "lost"
        publish_status(self.relay, job_id=self.attempt.job_id)
        return status

    def decide(
        self, *, rc: int, out: Outcome, memory_limit: int | None, oom_before: int | None = None
    ) -> str:
        """`memory_limit` and `oom_before` (the cgroup's OOM-kill count when the attempt started):
        the attempt's, for telling an out-of-memory or infrastructure failure from the job's own."""
        view = _view(self.settings, self.attempt, self.node_rank)
        if not view.intact:
            return "lost"
        where = f"node {self.node_rank} on {self.worker}"
        if out.stopped == "drain":
            why = drain_reason(default=f"{where} shut down")
            return self.give_back(f"{why}; the gang resumes from its checkpoint", restart=False)
        if view.cancel or view.preempt:
            if view.cancel and self.node_rank == 0:
                return self.finish(JobStatus.cancelled)
            if view.preempt:
                why = view.wait_reason or "preempted"
                return self.give_back(f"{why}; the gang resumes from its checkpoint", restart=False)
            return self.wait_for_end()
        if rc == 0:
            return self.finish_ok() if self.node_rank == 0 else self.wait_for_end()
        if view.has_result:  # the job's result is in: node 0 ends it
            return self.wait_for_end() if self.node_rank else self.end_with_result(view)
        oom = out_of_memory_error(error=out.error, stderr_tail=list(out.stderr_tail), limit=memory_limit)
        infra = None
        if oom is None and out.stopped is None:
            stderr = "\n".join(out.stderr_tail)
            infra = infrastructure_failure(rc=rc, stderr=stderr, oom_before=oom_before)
        failure = oom or infra or out.failure(rc)
        # a spec the trainer refused, a limit, the user's code or a NaN loss fails on every
        # attempt alike: no restart (a rank killed by a signal is the infrastructure's)
        terminal = oom is not None or (infra is None and failure.startswith(JOB_OWN_FAILURES))
        return self.give_back(f"{where}: {failure}", restart=True, fail=terminal)

    def finish(self, status: JobStatus, error: str | None = None) -> str:
        with session_for(self.settings.database_url) as s:
            eid = finish_job(s, attempt=self.attempt, status=status, error=error, judge=judge)
        if eid is None:
            return "lost"
        publish_status(self.relay, job_id=self.attempt.job_id)
        return str(status)

    def _hold(self, until: Callable[[GangView], bool]) -> GangView | None:
        """Keep this node's lease alive until `until(view)` or the gang is over (None), for at most
        db_retry_s + 2 lease periods (time for another node's relay to apply its last lines)."""
        deadline = time.monotonic() + self.settings.db_retry_s + 2 * self.settings.lease_s
        renewed = time.monotonic()
        while time.monotonic() < deadline:
            view = _view(self.settings, self.attempt, self.node_rank)
            if not view.intact:
                return None
            if until(view):
                return view
            if time.monotonic() - renewed > self.settings.lease_s / 3:
                with session_for(self.settings.database_url) as s:
                    if not renew_node(
                        s, attempt=self.attempt, node_rank=self.node_rank, lease_s=self.settings.lease_s
                    ):
                        return None
                renewed = time.monotonic()
            time.sleep(0.3)
        return _view(self.settings, self.attempt, self.node_rank)

    def finish_ok(self) -> str:
        """Node 0's trainer ended cleanly: the result may be printed by a rank on another node, so
        wait for it to be applied, then end the job."""
        view = self._hold(lambda v: v.has_result)
        if view is None:
            return "lost"
        if view.has_result:
            return self.end_with_result(view)
        return self.give_back("the gang's trainers ended but no node reported the result", restart=True)

    def end_with_result(self, view: GangView) -> str:
        """A result that says the run stopped early came from a stop asked on another node (its
        warm shutdown stops every rank at one step): the gang goes back, not counted."""
        if view.stopped:
            return self.give_back(
                "a node of the gang shut down; it resumes from its checkpoint", restart=False
            )
        return self.finish(JobStatus.succeeded)

    def wait_for_end(self) -> str:
        """A node > 0 whose part ended: it stays (its lease alive, so the reaper does not take its
        silence for a loss) until node 0 ends the job or the gang is given back."""
        self._hold(lambda _v: False)
        return "done"
