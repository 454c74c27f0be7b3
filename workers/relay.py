"""Applies a trainer's lines to the database, in batches, fenced, and then publishes them.

The pump thread only appends parsed lines here; a flusher thread applies everything pending every
`flush_s` seconds (longer when flushes are dear: `flush_wait`) in ONE transaction per batch (metric
points by insert-or-update on (job, name, step), log and trainer events, a result the moment it
arrives, a trial's best metric and its end)
and renews the leases of every attempt it serves in that same transaction. Each job's part is
fenced by (job id, attempt, owner): a stale attempt writes nothing and is reported through
`on_fenced`. A batch that fails (database locked, unreachable) is kept and retried; one that keeps
failing for `db_retry_s` marks the relay broken and the supervisor kills the trainer (the lease then
runs out and the job runs again from its checkpoint). Redis gets the rows after the commit, with
their ids (the dashboard's streams resume by id) through a publisher thread that never holds up
this one; losing Redis, or Redis hanging, loses nothing. After each commit that moved a job's
applied_step it rewrites the `applied-step` file of the attempt's checkpoint folder
(jobrules/applied.py), so the trainer's pruning keeps the checkpoint a resume needs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.broker import JOBS_CHANNEL
from core.messages import Message
from core.safe_files import folder as opened_folder
from core.settings import Settings
from db.connection import session_for
from db.gangs import apply_gang_lines
from db.ingest import Applied, JobLines, apply_lines
from db.jobs import Attempt, db_now
from db.models import Trial
from db.selections import TrialProgress, apply_trial_lines, lock_selection_writes, trial_fields
from jobrules.applied import write_applied_step
from jobrules.divergence import judge
from jobrules.user_metrics import BUILT_IN, MAX_NAMES, RESERVED_PREFIX, name_problem
from workers.publisher import live_publisher
from workers.supervise import DRAIN

log = logging.getLogger(__name__)

FLUSH_DUTY = 0.05
"""The share of one core the flusher may spend: after a flush that cost c seconds of its thread's
CPU it waits at least c / FLUSH_DUTY. A group of 8 trials costs ~45 ms of SQLAlchemy per flush (about
five statements per trial), which at the 0.2 s floor took a fifth of a core from its trainer on a
2-core node; waiting longer makes each flush bigger, not dearer."""
FLUSH_MAX_S = 2.0
"""The longest wait between flushes, whatever they cost (the dashboard's live latency)."""


FLUSH_SLICE_LINES = 400
"""The most lines one transaction applies. SQLite has one writer at a time, and a writer that
finds the lock taken sleeps in SQLite's busy handler in growing steps (1, 2, 5 ... 25, 50, 100 ms):
a flush of a fast job's few thousand points held the lock 110-150 ms, and a submit that arrived
meanwhile answered 150-250 ms late (bench.api_load's POST p99). A bigger backlog goes in slices of
this many lines (about 15 ms of lock each), each its own commit, with FLUSH_SLICE_GAP_S between
them. The lines are in arrival order, and each job's lines in sequence order, so a slice applies a
prefix of every job's lines: a crash between slices leaves each job's applied sequence number at
what it holds, and the rest is applied once on the next try."""
FLUSH_SLICE_GAP_S = 0.02
"""The pause between slices: long enough for a writer waiting in SQLite's busy handler to find
the lock free at its next try (its tries come 1-25 ms apart in the first 100 ms)."""


def flush_wait(cpu_s: float, *, floor_s: float) -> float:
    """Seconds to wait before the next flush after one that cost `cpu_s` of CPU."""
    return min(max(floor_s, cpu_s / FLUSH_DUTY), max(floor_s, FLUSH_MAX_S))


FINAL = frozenset({"succeeded", "stopped_early", "stopped", "failed", "cancelled"})


@dataclass(slots=True)
class Target:
    """One attempt this relay writes for: a job, or one trial of a group."""

    attempt: Attempt
    channels: tuple[str, ...]
    trial_id: int | None = None
    node_rank: int | None = None
    """Set for one node of a multi-node job (workers/gang.py): its writes are fenced by the gang's
    rule (db/gangs.py apply_gang_lines) and renew this node's own lease."""
    run_base: float = 0.0
    """Seconds the job's earlier attempts ran (jobs.run_seconds at the claim)."""
    started: float = field(default_factory=time.monotonic)
    """When this attempt started (this process's monotonic clock)."""
    checkpoints: Path | None = None
    """The attempt's checkpoint folder, whose `applied-step` file the relay keeps current."""
    marked: int | None = None
    """The applied step this relay last wrote there (the worker writes the claim's before the
    trainer starts: workers/execute.py mark_applied)."""

    def run_seconds(self) -> float:
        return self.run_base + time.monotonic() - self.started


class Relay:
    """Thread-safe. Keys: None for a plain job, the trial index for a group's trials."""

    def __init__(
        self,
        settings: Settings,
        *,
        targets: dict[int | None, Target],
        on_fenced: Callable[[int | None], None],
        metric: str = "val_loss",
        mode: str = "min",
        selection_channel: str | None = None,
        selection_id: int | None = None,
        flush_s: float = 0.2,
    ) -> None:
        self.settings = settings
        self.targets = targets
        self.on_fenced = on_fenced
        self.metric, self.mode = metric, mode
        self.selection_channel = selection_channel
        self.selection_id = selection_id
        self.fenced: set[int | None] = set()
        self.finished: set[int | None] = set()
        """Trials whose end was written (their job is terminal; later lines are dropped)."""
        self.broken: str | None = None
        self.points_written = 0
        self.flushes = 0
        """Flusher ticks that went through (tests, logs)."""
        self._final: dict[int, tuple[str, str | None, int]] = {}
        self._result_seen: set[int] = set()
        self._result_error: dict[int, str | None] = {}
        self._pending: list[tuple[int | None, Message]] = []
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._renewed = time.monotonic()
        self._failing_since: float | None = None
        self._last_progress: dict[int | None, float] = {}
        self._trial_rows: dict[int | None, dict[str, Any]] = {}
        self._user_names: dict[int | None, set[str]] = {}
        """The user metric names each job (trial) reported: the trainer caps them, and so does this."""
        self._dropped: set[tuple[int | None, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(flush_s,), daemon=True, name="relay")
        self._thread.start()

    # ---- input (the pump thread) ---------------------------------------------------------------

    def add(self, key: int | None, msg: Message) -> None:
        if key not in self.targets:
            return
        with self._lock:
            self._pending.append((key, msg))

    def add_target(self, key: int, target: Target) -> None:
        """A trial that joined the group while it runs (a sampler's next one: workers/search.py)."""
        with self._flush_lock:
            self.targets = {**self.targets, key: target}  # a new dict: readers keep the one they hold

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def ended(self, key: int) -> tuple[str, str | None] | None:
        """The final status a trial reported, once applied with its result (else None)."""
        return self._final[key][:2] if key in self.finished else None

    # ---- applying ----------------------------------------------------------------------------

    def _admit_metric(self, key: int | None, name: str) -> bool:
        """Whether a metric line may be stored: the trainer's and the worker's own names, and a
        user's own (trainer/report.py) that follow jobrules/user_metrics.py's rules, at most
        MAX_NAMES of them per job. The trainer checks the same before it writes a line; this
        keeps a line the job's own code forged on the protocol channel out of the database (a
        name too long for its column, thousands of names). A dropped name is logged once."""
        if name in BUILT_IN or (name.startswith(RESERVED_PREFIX) and len(name) <= 64):
            return True
        seen = self._user_names.setdefault(key, set())
        if name in seen:
            return True
        problem = name_problem(name)
        if problem is None and len(seen) >= MAX_NAMES:
            problem = f"the job already has {MAX_NAMES} metric names of its own"
        if problem is None:
            seen.add(name)
            return True
        if (key, name[:80]) not in self._dropped:
            self._dropped.add((key, name[:80]))
            log.warning("relay: dropped the metric lines of %r (%s): %s", name[:80], key, problem)
        return False

    def _route(self, batch: list[tuple[int | None, Message]]) -> tuple[dict, dict]:
        lines: dict[int | None, JobLines] = {}
        progress: dict[int, TrialProgress] = {}
        for key, msg in batch:
            jl = lines.setdefault(key, JobLines())
            if key is not None:
                progress.setdefault(key, TrialProgress(values=[]))
            if msg.kind == "metric":
                if not self._admit_metric(key, msg.name):
                    continue
                jl.metrics.append((msg.seq, msg.step, msg.name, msg.value, msg.time))
                if key is not None and msg.name == self.metric and msg.value == msg.value:  # not NaN
                    progress[key].values.append(msg.value)
                if key is not None and msg.name == "loss":
                    # a running trial's steps move with its curve, not only at its end
                    p = progress[key]
                    p.steps_done = max(p.steps_done or 0, msg.step)
            elif msg.kind == "log":
                jl.events.append((msg.seq, "log", msg.message, msg.data or None, msg.time))
            elif msg.kind == "event" and msg.message == "trial" and key is not None:
                status, steps = msg.data.get("status"), int(msg.data.get("steps_done", 0))
                progress[key].steps_done = steps
                # a trial stopped by a warm shutdown has not ended: it goes back to its batch
                if status in FINAL and not (status == "stopped" and DRAIN.is_set()):
                    self._final[key] = (str(status), msg.data.get("error"), steps)
            elif msg.kind == "event":
                jl.events.append((msg.seq, "event", msg.message, msg.data, msg.time))
            elif msg.kind == "result":
                jl.result = (msg.seq, msg.data)
                if key is not None:
                    self._result_seen.add(key)
                    self._result_error[key] = msg.data.get("error")
        # a trial ends once its final event AND its result are in this batch or an earlier one
        # (either order); its end goes into the same transaction as the later of the two
        for key in self._final.keys() & self._result_seen - self.finished - self.fenced:
            status, error, _ = self._final[key]
            finish = (status, error or self._result_error.get(key))
            p = progress.setdefault(key, TrialProgress(values=[]))
            p.finish, p.judge = finish, judge
        return lines, progress

    def flush(self, *, renew: bool = False) -> None:
        """Apply everything pending (and renew the leases): in one transaction, or a big backlog
        in slices of FLUSH_SLICE_LINES, each committed and published before the next. Raises on a
        database error, keeping what was not applied for the next try."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            due = renew or time.monotonic() - self._renewed > self.settings.lease_s / 3
            if not batch and not due:
                return
            for i in range(0, max(len(batch), 1), FLUSH_SLICE_LINES):
                if i:
                    time.sleep(FLUSH_SLICE_GAP_S)  # other writers take the lock in between
                try:
                    lines, progress = self._route(batch[i : i + FLUSH_SLICE_LINES])
                    applied, fenced = self._apply(lines, progress, renew_all=not i)
                except Exception:
                    with self._lock:  # this slice and the ones after it, for the next try
                        self._pending = batch[i:] + self._pending
                    raise
                self._applied(applied, fenced, progress)

    def _applied(self, applied: dict[int | None, Applied], fenced: list[int | None], progress: dict) -> None:
        """After a slice's commit: trials ended or fenced off, applied steps, the live messages."""
        self._renewed = time.monotonic()
        for key, p in progress.items():
            if p.finish is not None and key in applied:
                self.finished.add(key)
        for key in fenced:
            self.fenced.add(key)
            self.on_fenced(key)
        self._mark_applied(applied)
        self._publish(applied, progress)

    def _mark_applied(self, applied: dict[int | None, Applied]) -> None:
        """Write each job's new applied_step into its checkpoint folder (after the commit: the file
        may lag the database, never lead it). A folder that is gone stays gone; a write that fails
        is logged and tried again after the next commit (until then the trainer keeps the older
        step's checkpoint, which a resume may use as well)."""
        for key, got in applied.items():
            target = self.targets[key]
            if target.checkpoints is None or got.applied_step is None or got.applied_step == target.marked:
                continue
            # the folder is the trainer's: written in it as opened without following a link, and
            # a folder that is gone stays gone
            try:
                with opened_folder(target.checkpoints, root=target.checkpoints.parent) as d:
                    if write_applied_step(d, got.applied_step):
                        target.marked = got.applied_step
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not write the applied step to %s: %s", target.checkpoints, e)

    def _apply(
        self, lines: dict, progress: dict, *, renew_all: bool = True
    ) -> tuple[dict[int | None, Applied], list[int | None]]:
        """One transaction: each target's lines and its lease. `renew_all` False (a flush's later
        slices): only the targets with lines or progress in this slice, the first slice having
        renewed (and fence-checked) every lease moments before."""
        applied: dict[int | None, Applied] = {}
        fenced: list[int | None] = []
        with session_for(self.settings.database_url) as s:
            if self.selection_id is not None and any(not jl.empty() for jl in lines.values()):
                lock_selection_writes(s, selection_id=self.selection_id)
            now = db_now(s)
            for key, target in self.targets.items():
                if key in self.fenced or key in self.finished:
                    continue
                jl = lines.get(key) or JobLines()
                if not renew_all and jl.empty() and key not in progress:
                    continue
                if target.node_rank is not None:
                    got = apply_gang_lines(
                        s,
                        attempt=target.attempt,
                        node_rank=target.node_rank,
                        lines=jl,
                        lease_s=self.settings.lease_s,
                        now=now,
                        run_seconds=target.run_seconds(),
                    )
                elif target.trial_id is None:
                    got = apply_lines(
                        s,
                        attempt=target.attempt,
                        lines=jl,
                        lease_s=self.settings.lease_s,
                        now=now,
                        run_seconds=target.run_seconds(),
                    )
                else:
                    got = apply_trial_lines(
                        s,
                        trial_id=target.trial_id,
                        attempt=target.attempt,
                        lines=jl,
                        progress=progress.get(key) or TrialProgress(values=[]),
                        mode=self.mode,
                        lease_s=self.settings.lease_s,
                        now=now,
                        run_seconds=target.run_seconds(),
                    )
                if got is None:
                    fenced.append(key)
                else:
                    applied[key] = got
            s.commit()
            self._trial_rows = {
                key: trial_fields(s.get(Trial, self.targets[key].trial_id))  # type: ignore[arg-type]
                for key in progress
                if key in applied
            }
        return applied, fenced

    # ---- publishing --------------------------------------------------------------------------

    def publish(self, msg: dict[str, Any], *, channels: tuple[str, ...]) -> None:
        """Hand `msg` to this process's publisher thread (workers/publisher.py): a broker that is
        down or hung never holds up the database writes and lease renewals of this relay."""
        live_publisher(self.settings).send(msg, channels=channels)

    def drain_live(self, timeout_s: float = 5.0) -> None:
        """Let what was published go out before the task returns (best effort, bounded)."""
        live_publisher(self.settings).drain(timeout_s)

    def _publish(self, applied: dict[int | None, Applied], progress: dict) -> None:
        for key, got in applied.items():
            target = self.targets[key]
            job_id = target.attempt.job_id
            if got.metrics:
                self.points_written += len(got.metrics)
                self.publish({"type": "metrics", "points": got.metrics}, channels=target.channels)
            for ev in got.events:
                body = {k: ev[k] for k in ("id", "kind", "message", "data", "time")}
                self.publish({"type": "event", **body}, channels=target.channels)
                if ev["kind"] == "status":
                    self.publish({"job_id": job_id, "status": ev["message"]}, channels=(JOBS_CHANNEL,))
            if key in self._trial_rows and self.selection_channel:
                self.publish(
                    {"type": "trial", "trial": self._trial_rows[key]}, channels=(self.selection_channel,)
                )
            now = time.monotonic()
            if got.metrics and now - self._last_progress.get(key, 0.0) > 1.0:  # progress bars: 1/s at most
                self._last_progress[key] = now
                self.publish({"job_id": job_id, "status": "running"}, channels=(JOBS_CHANNEL,))

    # ---- the flusher thread ------------------------------------------------------------------

    def _run(self, flush_s: float) -> None:
        wait = flush_s
        while not self._stop.wait(wait):
            try:
                c0 = time.thread_time()
                self.flush()
                wait = flush_wait(time.thread_time() - c0, floor_s=flush_s)
                self.flushes += 1
                self._failing_since = None
            except Exception as e:  # noqa: BLE001 - keep the batch; the next tick retries the DB
                now = time.monotonic()
                self._failing_since = self._failing_since or now
                log.warning("relay flush failed (retrying): %s", e)
                if now - self._failing_since > self.settings.db_retry_s:
                    self.broken = f"database writes failed for {self.settings.db_retry_s:.0f}s: {e}"
                    return

    def close(self) -> bool:
        """Stop the flusher and apply what is left, retrying for up to `db_retry_s`. True when
        every line is in the database (or fenced off, when the attempt is no longer ours)."""
        self._stop.set()
        self._thread.join(timeout=30)
        deadline = time.monotonic() + self.settings.db_retry_s
        while True:
            try:
                self.flush(renew=True)
                if self.pending() == 0:
                    return True
            except Exception as e:  # noqa: BLE001 - locked or unreachable: wait and retry
                log.warning("final flush failed (retrying): %s", e)
            if time.monotonic() > deadline:
                self.broken = self.broken or f"database writes failed for {self.settings.db_retry_s:.0f}s"
                return False
            time.sleep(0.5)


def retry_db(settings: Settings, what: str, fn: Callable[[], Any]) -> Any:
    """Run one database unit of work, retrying it while the database is locked or unreachable,
    for up to `db_retry_s`; then the error propagates (the attempt's lease runs out)."""
    deadline = time.monotonic() + settings.db_retry_s
    while True:
        try:
            return fn()
        except Exception as e:
            if time.monotonic() > deadline or not _transient(e):
                raise
            log.warning("%s failed (retrying): %s", what, e)
            time.sleep(0.5)


def _transient(e: Exception) -> bool:
    from sqlalchemy.exc import DBAPIError, OperationalError

    return isinstance(e, OperationalError) or (isinstance(e, DBAPIError) and e.connection_invalidated)
