"""One attempt of one trainer process, written once.

Every attempt goes through the same phases, in this order:

    claim -> restore -> prepare -> launch (supervise, relay) -> settle (upload, close) -> end -> prune

A job (workers/execute.py), one node of a gang (workers/gang.py) and one group of a selection batch
(workers/selection.py) are users of `AttemptRun`: each adds only what is its own (how it claims,
the command it launches, what its stop poll asks, how its end is decided). A launcher that starts
an attempt somewhere else (a Slurm allocation's node agent) calls the same functions.

Exactly once: the final status is written only after the trainer exited and every line it wrote
is applied; a kill anywhere before that leaves the job `running` under a lease nobody renews, and
whoever takes it next resumes from the latest checkpoint whose lines are all in the database
(checkpoints past it are dropped first, `drop_checkpoints_past`), so every metric step is stored
once.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from core import safe_files
from core.broker import JOBS_CHANNEL, job_channel
from core.messages import Message
from core.safe_files import folder as opened_folder
from core.settings import Settings
from core.storage import StorageError, checkpoints_prefix, get_storage
from db.connection import session_for
from db.ingest import last_status_event
from db.jobs import (
    Attempt,
    NotFound,
    claim_job,
    free_job_reservations,
    get_job,
    lease_left_s,
    reserved_here,
)
from db.models import TERMINAL
from db.quotas import quota_gate
from jobrules.applied import write_applied_step
from jobrules.restarts import max_restarts
from jobrules.spec import ParallelSpec
from workers import lost, pyenv
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
from workers.failures import oom_kill_count
from workers.hardware import HardwareSampler
from workers.limits import out_of_memory_error
from workers.logcap import LogCap
from workers.relay import Relay
from workers.sandbox import Sandbox, SandboxUnavailable
from workers.spare import Spare
from workers.supervise import Ask, Outcome, supervise

log = logging.getLogger(__name__)

_OWNER: dict[int, str] = {}


# ---- claim ---------------------------------------------------------------------------------------


def owner_id() -> str:
    """This worker process start's unique id: leases belong to it, never to a reusable name."""
    pid = os.getpid()
    if pid not in _OWNER:  # a forked pool child gets its own
        _OWNER[pid] = f"{lost.owner_prefix(pid)}{uuid.uuid4().hex[:12]}"
    return _OWNER[pid]


class QuotaWait(Exception):
    """The job's owner is at their quota: the job waits in the queue (the reason is on the job)."""


def take_lease(
    settings: Settings,
    *,
    job_id: int,
    worker: str,
    kind: str = "job",
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
                max_restarts=max_restarts,
            )
            if attempt is not None:
                return attempt
            left = lease_left_s(s, job_id=job_id)
        if left is None or time.monotonic() > deadline:
            return None
        time.sleep(min(max(left, 0.0) + 0.2, 2.0))


# ---- restore -------------------------------------------------------------------------------------


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
            safe_files.remove(p, root=ckpt_dir.parent)  # never through a link the trainer left
            dropped.append(p)
    return dropped


def mark_applied(ckpt_dir: Path, step: int) -> None:
    """Before the trainer starts: the job's applied step into its checkpoint folder, which the
    trainer's pruning reads (jobrules/applied.py; the relay rewrites it as the step moves). A
    write that fails only warns: the trainer then prunes by the file an earlier attempt left (a
    step at or below this one, still one a resume may use) or, without one, by count alone."""
    try:
        # the folder is the trainer's: written in the folder opened without following a link
        with opened_folder(ckpt_dir, root=ckpt_dir.parent, create=True) as d:
            write_applied_step(d, step)
    except OSError as e:
        log.warning("could not write the applied step to %s: %s", ckpt_dir, e)


def restore_checkpoints(
    settings: Settings,
    *,
    ckpt_dir: Path,
    job_id: int,
    applied_step: int,
    relay: Relay,
    parallel: ParallelSpec,
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
        storage=storage, local=ckpt_dir, prefix=checkpoints_prefix(job_id), pieces=parallel.checkpoint_pieces
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


# ---- the live status -----------------------------------------------------------------------------


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
    relay.publish(body, channels=(job_channel(job_id), *_extra_channels(relay, job_id)))
    relay.publish({"job_id": job_id, "status": ev.message}, channels=(JOBS_CHANNEL,))


def _extra_channels(relay: Relay, job_id: int) -> tuple[str, ...]:
    for t in relay.targets.values():
        if t.attempt.job_id == job_id:
            return tuple(c for c in t.channels if c != job_channel(job_id))
    return ()


# ---- prune ---------------------------------------------------------------------------------------


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
                log.info(
                    "job %s: checkpoints left to its next attempt (%s, attempt %s of %s)",
                    attempt.job_id,
                    job.status,
                    attempt.attempt,
                    job.attempts,
                )
                return
            applied = job.applied_step
        prune_local(ckpt_dir, keep=keep, applied=applied)
        for mirror in mirrors:
            mirror.prune_store(keep=keep, applied=applied)
    except (OSError, StorageError, SQLAlchemyError, NotFound) as e:  # NotFound: deleted meanwhile
        log.warning("job %s: checkpoints not pruned at its end: %s", attempt.job_id, e)


# ---- one trainer process -------------------------------------------------------------------------


@dataclass(kw_only=True)
class AttemptRun:
    """One trainer process's phases after its claim: `restore`, `prepare`, `launch`, `settle`.
    Its user builds the relay (one target per job or trial it writes for) and the command; the
    run owns the process, its sandbox (workers/sandbox.py), its environment, its hardware samples,
    its checkpoint uploads and the order in which they stop."""

    settings: Settings
    relay: Relay
    folder: Path
    """Where the stop file and the stderr log live (`<stem>stop`, `<stem>stderr.log`)."""
    what: str
    """The attempt in the worker's log, e.g. 'job 3 attempt 2'."""
    memory_limit: int | None
    sandbox: Sandbox
    spare: Spare | None = None
    """The sandboxed trainer made ahead for this run, adopted as its folder (workers/spare.py)."""
    stem: str = ""
    out: Outcome = field(default_factory=Outcome)
    uploader: Uploader | None = None
    env: pyenv.PreparedEnv | None = None
    oom_before: int | None = field(default_factory=oom_kill_count)
    """The memory cgroup's OOM-kill count at the start (workers/failures.py)."""
    marks: dict[str, float] = field(default_factory=dict)
    """When the run reached `launch` and `exited` (Unix seconds)."""

    @property
    def stop_file(self) -> Path:
        return self.folder / f"{self.stem}stop"

    @property
    def stderr_log(self) -> Path:
        return self.folder / f"{self.stem}stderr.log"

    def restore(self, fetch: Callable[[], Uploader | None]) -> str | None:
        """The checkpoints (and whatever else `fetch` brings from the store) before the trainer
        starts, once the sandbox it needs is known to be possible here. Returns the failure to end
        the attempt with: the store cannot be read, or this worker cannot sandbox users' code."""
        try:
            self.sandbox.check()
            self.uploader = fetch()
        except SandboxUnavailable as e:
            return str(e)
        except StorageError as e:
            return storage_failure(e)
        return None

    def prepare(self, env: pyenv.PreparedEnv) -> None:
        """The run's own requirements (workers/pyenv.py), built or found by the worker outside
        any sandbox, held until `settle`; the sandbox mounts them read-only."""
        self.env = env
        if env.error:
            self.out.error = env.error
        elif env.path is not None:
            self.sandbox.read_only.append(env.path)

    def launch(
        self,
        cmd: list[str],
        *,
        poll: Callable[[], Ask],
        on_message: Callable[[Message], None],
        on_sample: Callable[[str, float], None],
        on_output: Callable[[int | None, str, str], None] | None = None,
    ) -> int:
        """Run the trainer to its end under `poll` (in its sandbox), every protocol line to
        `on_message`, its own output to `on_output`, a hardware sample to `on_sample(name,
        value)`. Returns its exit code (1, with no trainer run, when the environment failed)."""
        self.marks["launch"] = time.time()
        if self.env is not None and self.env.error:
            if self.uploader is not None:
                self.uploader.stop(final=False)  # no trainer ran: nothing new to upload
                self.uploader = None
            self.marks["exited"] = time.time()
            return 1
        samplers: list[HardwareSampler] = []
        full = cmd + (self.env.args if self.env is not None else [])
        try:
            rc = supervise(
                full,
                on_message=on_message,
                on_output=on_output,
                on_start=lambda pid: samplers.append(
                    HardwareSampler(pid, emit=on_sample, every_s=self.settings.hw_sample_s).start()
                ),
                poll=poll,
                stop_file=self.stop_file,
                stderr_log=self.stderr_log,
                grace_s=self.settings.cancel_grace_s,
                shutdown_grace_s=self.settings.shutdown_grace_s,
                out=self.out,
                memory_limit=self.memory_limit,
                sandbox=self.sandbox,
                spare=self.spare,
            )
        finally:
            self.marks["exited"] = time.time()
            for sm in samplers:
                sm.stop()
        return rc

    def settle(self, *, final_upload: Callable[[], bool] = lambda: True) -> bool:
        """After the trainer exited: its environment released, its last checkpoints uploaded (if
        `final_upload()`: the attempt is still ours), then every line applied. The relay closes
        last: its thread keeps the leases alive meanwhile. False when the attempt was lost (fenced
        off, or the database stayed unreachable: the lease then runs out)."""
        if self.env is not None:
            self.env.release()
        if self.uploader is not None:
            self.uploader.stop(final=not self.relay.broken and final_upload())
        if not self.relay.close():
            log.warning("%s: %s", self.what, self.relay.broken)
            if cause := lost.disk_full(self.relay.broken):
                for target in self.relay.targets.values():
                    lost.record(self.settings, worker=None, owner=target.attempt.owner, cause=cause)
            return False
        return True

    def oom(self) -> str | None:
        """The out-of-memory error, when the run ended for lack of memory."""
        return out_of_memory_error(
            error=self.out.error, stderr_tail=list(self.out.stderr_tail), limit=self.memory_limit
        )

    @property
    def mirrors(self) -> list[Mirror]:
        return list(self.uploader.mirrors) if self.uploader is not None else []


class OneTarget:
    """The lines of a run that writes for one job (a job, or one node of a gang): its protocol
    lines, its own output through the log cap (workers/logcap.py: a head and a tail stored, the
    rest shown live) and its hardware samples at its current step."""

    def __init__(self, run: AttemptRun, *, torchrun: bool) -> None:
        self.run = run
        relay = run.relay
        self.channels = next(iter(relay.targets.values())).channels
        self.step = 0
        self.cap = LogCap(
            self._store_log,
            head=run.settings.log_head_lines,
            tail=run.settings.log_tail_lines,
            live=self._live_log,
        )
        # output that names no rank: rank 0 of a single-process trainer; unknown under torchrun
        run.out.rank = None if torchrun else 0

    def _store_log(self, rank: int | None, stream: str, text: str, at: float) -> None:
        msg = Message(kind="log", message=text, time=at, data={"rank": rank, "stream": stream})
        self.run.relay.add(None, msg)

    def _live_log(self, rank: int | None, stream: str, text: str, at: float) -> None:
        # past the stored head: shown live, stored only if it ends up in the tail
        body = {"type": "live_log", "message": text, "time": at, "rank": rank, "stream": stream}
        self.run.relay.publish(body, channels=self.channels)

    def on_message(self, msg: Message) -> None:
        if msg.kind == "metric":
            self.step = max(self.step, msg.step)
        self.run.relay.add(None, msg)
        if self.run.uploader is not None and msg.kind == "event" and msg.message == "checkpoint":
            self.run.uploader.wake()

    def on_output(self, rank: int | None, stream: str, text: str) -> None:
        self.cap.add(rank=rank, stream=stream, text=text)

    def on_sample(self, name: str, value: float) -> None:
        # seq None: applied whatever the attempt's sequence; stored once per (name, step)
        self.run.relay.add(None, Message(kind="metric", step=self.step, name=name, value=value))

    def launch(self, cmd: list[str], *, poll: Callable[[], Ask]) -> int:
        try:
            return self.run.launch(
                cmd, poll=poll, on_message=self.on_message, on_sample=self.on_sample, on_output=self.on_output
            )
        finally:
            self.cap.close()
