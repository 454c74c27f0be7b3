"""Shard alternation over a node's devices: the selection batch's executor.

One worker thread per device. A free device asks the scheduler (trainer/selection/scheduler.py)
for an idle trial, runs that trial's next task (one shard: forward, or recompute + backward + step),
and hands the trial back. A trial is held by at most one device at a time, so it runs on one device
at a time; its tasks still go to whichever device is free, since the host holds its shards between
tasks. Double buffering across trials: when a device is dispatched it also picks the trial it will
run next and copies that trial's next shard in on a side stream while the current one computes (on
CPU the copy is a no-op, same code path). ASHA decisions are taken at mini-batch ends; stopped trials
free their device at once.

A batch that grows as it runs (a sampler's: workers/search.py) gives `more`: at the dispatch point,
once a trial has ended since it was last consulted, one free device asks it (outside the lock; the
other devices go on) for the trials due now, and adds those it returns to the run (usually one;
two where the sampler's clock asks two at once, the batch's last trial beside the one before it, so
the devices can share the last three); none means none now.
The run ends when every trial has ended and `more`, asked after the last end, had none.

Threading: every piece of shared state (trial status, holders, ledgers, ASHA) changes under
`self._cond`; a trial's tensors are touched only by the device that holds it, outside the lock.

CPU devices are processes (trainer/selection/devices.py): each device thread here stays the
device's dispatcher, every decision stays in this process, and the task itself runs in the
device's forked process on the trial's tensors in shared memory. There a trial changes device only
between mini-batches (its boundary activations live in the process that began the mini-batch).
CUDA devices stay threads: CUDA cannot be forked once initialised.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from jobrules.spec import CHECKPOINT_POLICIES, BatchRules, JobSpec
from jobrules.user_metrics import is_user_metric, ranked_metric_problem
from trainer.after_step import AfterStep, report_eval, report_step
from trainer.protocol import MetricsSink, NeverStop, StopSignal
from trainer.report import NameLimit, Reports, emit
from trainer.selection.devices import Adoption, DeviceDied, DeviceProcesses, Done, Order, execute
from trainer.selection.halving import Decisions, Halving, HalvingConfig, StopReason
from trainer.selection.reservations import Reservations
from trainer.selection.scheduler import Scheduler, TrialView, make_scheduler
from trainer.selection.shards import Place, ShardedTrial
from trainer.spill.ledger import DeviceLedger

Status = Literal["pending", "running", "paused", "succeeded", "stopped_early", "stopped", "failed"]
FINAL = ("succeeded", "stopped_early", "stopped", "failed")
_REQUEST = BatchRules()
"""The selection request's defaults (jobrules/spec.py), for an executor built without one."""


@dataclass(kw_only=True, slots=True)
class TrialEntry:
    index: int
    job: JobSpec
    sink: MetricsSink
    checkpoint_dir: Path | None = None
    warm_start: Path | None = None
    """A checkpoint (file or directory) whose weights this trial starts from."""


@dataclass(kw_only=True, slots=True)
class ExecutorConfig:
    scheduler: str = _REQUEST.scheduler
    metric: str = _REQUEST.metric
    """What ASHA and the leaderboard rank by: loss, val_loss or a metric the trials' own code
    reports (trainer/report.py)."""
    mode: Literal["min", "max"] = _REQUEST.mode
    early_stopping: HalvingConfig | None = None
    """ASHA, successive halving or Hyperband rungs (trainer/selection/halving.py); None: none."""
    checkpoints: str = _REQUEST.checkpoints
    """Which end-of-trial checkpoints stay once trials end: the best trial's (`best`), every
    trial's (`all`) or none (`none`); a trial's directory goes with them."""
    prefetch: bool = True
    """Copy the next chosen trial's shard in while the current one computes."""
    device_budget_bytes: int | None = None
    """Each device's budget; None: unlimited (CPU devices)."""
    poll_s: float = 0.05
    """How often an idle device re-reads the stop signals."""
    device_processes: bool | None = None
    """Run each CPU device as a forked process (trainer/selection/devices.py) rather than a thread
    of this one; None: processes when there are several CPU devices, threads otherwise (one
    device, or CUDA, which cannot be forked once initialised)."""
    chunk_tasks: int = 256
    """Device processes: the most tasks one order may carry when no other trial could use the
    device meanwhile (a lone trial); 1: one task an order, always."""
    send_ahead: bool = True
    """Device processes: send the order of the trial a device reserved to run next as soon as its
    running order's last task ends, before that task is booked (Executor._send_ahead); False: each
    order once the one before is booked."""

    def __post_init__(self) -> None:
        if (problem := ranked_metric_problem(self.metric)) is not None:
            raise ValueError(problem)
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be min or max, got {self.mode!r}")
        make_scheduler(self.scheduler)  # names the valid ones
        if self.checkpoints not in CHECKPOINT_POLICIES:
            raise ValueError(
                f"checkpoints must be one of {', '.join(CHECKPOINT_POLICIES)}, got {self.checkpoints!r}"
            )
        if self.device_budget_bytes is not None and self.device_budget_bytes <= 0:
            raise ValueError(f"device budget must be > 0 bytes, got {self.device_budget_bytes}")
        if self.chunk_tasks < 1:
            raise ValueError(f"chunk_tasks must be >= 1, got {self.chunk_tasks}")


def uses_processes(cfg: ExecutorConfig, devices: list[torch.device]) -> bool:
    """Whether the devices run as forked device processes: as `cfg.device_processes` says, and
    by default when there are several CPU devices (one device, or CUDA: threads)."""
    if cfg.device_processes is not None:
        return cfg.device_processes
    return all(d.type == "cpu" for d in devices) and len(devices) > 1


@dataclass(kw_only=True, slots=True)
class Slot:
    """One task as it ran, for tests and the benchmark."""

    trial: int
    device: int
    kind: str
    shard: int
    start: float
    end: float
    compute_s: float
    copy_s: float


@dataclass(kw_only=True, slots=True)
class TrialRun:
    entry: TrialEntry
    trial: ShardedTrial | None = None
    status: Status = "pending"
    holder: int | None = None
    """Device that holds the trial (running a task, or reserved after a prefetch)."""
    stop_requested: bool = False
    dispatches: int = 0
    last_dispatch: int = -1
    step_times: list[float] = field(default_factory=list)
    done_in_step_s: float = 0.0
    last_metric: float | None = None
    best_metric: float | None = None
    val_loss: float = float("nan")
    reports: Reports = field(default_factory=Reports)
    """What the trial's own code reported during its running step (trainer/report.py)."""
    names: NameLimit = field(default_factory=NameLimit)
    error: str | None = None
    compute_s: float = 0.0
    copy_s: float = 0.0
    busy_s: float = 0.0
    """Device-thread time spent on this trial's own tasks (task, evaluation, bookkeeping after it;
    a prefetch of another trial made in the same slot is not counted)."""
    dispatch_s: float = 0.0
    """Device-thread time from the device being free to this trial's task starting, minus waits
    for work: the scheduler's choice, the lock, the reservations."""
    prefetch_s: float = 0.0
    """Of copy_s, the part copied by a prefetch (in another trial's slot)."""
    started: bool = False
    stop_reason: StopReason | None = None
    """Why the rungs stopped the trial (its rung, its value, the rung's cut-off)."""
    prefetches: int = 0
    """Times a device reserved the trial as its next one while running another (double buffering)."""
    pinned: int | None = None
    """Device processes: the device whose process holds the trial's mini-batch in progress (or, for a
    trial whose data carries state, the trial for good); only it may take the trial's next task."""
    block: torch.Tensor | None = None
    """Device processes: the trial's shared-memory block (ShardedTrial.share); None once the
    trial has ended (released)."""
    orders: int = 0
    """Device processes: orders sent for this trial (one task each, or a chunk of a lone trial's)."""
    released: bool = False
    """The trial has ended and its tensors (and, with device processes, its block) were let go."""

    @property
    def index(self) -> int:
        return self.entry.index

    @property
    def sink(self) -> MetricsSink:
        return self.entry.sink


class Executor:
    def __init__(
        self,
        entries: list[TrialEntry],
        *,
        devices: list[torch.device],
        cfg: ExecutorConfig,
        stop: StopSignal | None = None,
        stop_trials: Callable[[], set[int]] | None = None,
        scheduler: Scheduler | None = None,
        more: Callable[[], list[TrialEntry]] | None = None,
    ) -> None:
        if not devices:
            raise ValueError("a selection batch needs at least one device")
        cpu = all(d.type == "cpu" for d in devices)
        if cfg.device_processes and not cpu:
            raise ValueError(
                f"device processes are for CPU devices only (CUDA cannot be forked once initialised), "
                f"got {', '.join(map(str, devices))}"
            )
        self.processes = uses_processes(cfg, devices)
        """CPU devices run as processes (trainer/selection/devices.py)."""
        if len({e.index for e in entries}) != len(entries):
            raise ValueError("trial indices must be unique")
        self.cfg = cfg
        self.devices = devices
        self.scheduler = scheduler or make_scheduler(cfg.scheduler)
        self.stop = stop or NeverStop()
        self.stop_trials = stop_trials or (lambda: set())
        self.runs = {e.index: TrialRun(entry=e) for e in entries}
        if more is not None and cfg.early_stopping is not None:
            raise ValueError("a batch that grows as it runs (more) cannot have early stopping rungs")
        self.more = more
        self._asking = False
        self._asked_at = -1
        """How many trials had ended when `more` last answered None (-1: never asked)."""
        self.reservations = [
            Reservations(device=f"{d}#{i}", budget_bytes=cfg.device_budget_bytes)
            for i, d in enumerate(devices)
        ]
        self.rungs: Halving | None = None
        self._kept: int | None = None
        """Checkpoints `best`: the ended trial whose checkpoints are kept so far."""
        self.trace: list[Slot] = []
        self._cond = threading.Condition()
        self._waiting = 0
        self._dispatches = 0
        self._stopping = False
        self._last_poll = 0.0
        self._flops_rate: float | None = None
        self._fatal: BaseException | None = None
        self.idle_s = [0.0] * len(devices)
        """Per device: time it had no trial to run before the batch's end (waiting for one, or
        asking `more` for one)."""
        self.ask_s = [0.0] * len(devices)
        """Per device: of idle_s, the time spent asking `more` (a growing batch)."""
        self._procs: DeviceProcesses | None = None
        self._forget: list[list[int]] = [[] for _ in devices]
        """Device processes, per device: ended trials its process still holds, to drop (Forget)."""
        self._started = False
        self.dead: list[str | None] = [None] * len(devices)
        """Per device: why its process died (device processes only), or None while it serves."""
        self.orders_ahead = 0
        """Device processes: orders sent ahead (_send_ahead), of all the trials' `orders`."""
        self.marks: dict[str, float] = {}
        """When `run` reached each phase (Unix seconds): `prepare` (it began building the trials on
        the host), `built`, `devices` (the device processes forked; with threads, when they start),
        `ended` (every device done, the device processes closed)."""
        budget = cfg.device_budget_bytes
        # the real bytes on each device (the spilling engine's ledger; strict: passing the budget
        # raises), beside `self.reservations`, the scheduler's plan
        self.places = [
            Place(
                device=d,
                ledger=DeviceLedger(budget_bytes=budget, strict=budget is not None),
                stream=torch.cuda.Stream(device=d) if d.type == "cuda" and cfg.prefetch else None,
            )
            for d in devices
        ]

    # -- set-up ----------------------------------------------------------------------------------

    def add_trial(self, entry: TrialEntry) -> TrialRun:
        """Add a trial, before `run` or while it runs (from this process: a device thread, a
        sink); a free device takes it like any other. Device processes get it with its first task.
        Trials that early stopping ranks must all be known when the run starts."""
        with self._cond:
            if self.rungs is not None:
                raise ValueError("trials cannot join a batch with early stopping once it has started")
            run = TrialRun(entry=entry)
            self._join(run, self._cut(run) if self._started else None)
            self._cond.notify_all()
        return run

    def _join(self, run: TrialRun, failed: tuple[Exception, str] | None) -> None:
        """Under the lock: a trial joins the batch (add_trial, or `more` of a growing batch); once
        the run has started it is already cut (`failed`: why it could not be), before that the
        run's own preparation builds it."""
        if run.index in self.runs:
            raise ValueError(f"trial index {run.index} is already in the batch")
        self.runs[run.index] = run
        if self._started:
            self._built(run, failed)

    def _prepare(self) -> None:
        """Build and cut every trial on the host; a trial that cannot be built or can never fit a
        device fails alone, with the reason, and the others run."""
        for run in list(self.runs.values()):
            self._build(run)
        max_steps = {i: r.entry.job.train.steps for i, r in self.runs.items()}
        if self.cfg.early_stopping is not None:
            self.rungs = Halving(self.cfg.early_stopping, max_steps=max_steps)
            for run in self.runs.values():
                if run.status in FINAL:
                    self.rungs.finished(run.index, step=run.trial.step if run.trial else 0)
                elif run.trial.step > 0:
                    self.rungs.resumed(run.index, step=run.trial.step)

    def _build(self, run: TrialRun) -> None:
        """Build and cut one trial on the host (with device processes, in shared memory); a trial
        that cannot be built or can never fit a device fails alone, with the reason."""
        self._built(run, self._cut(run))

    def _cut(self, run: TrialRun) -> tuple[Exception, str] | None:
        """Build the trial's shards on the host, in shared memory with device processes (touches
        only `run`: no lock needed); the error and its traceback where it could not be built."""
        e = run.entry
        try:
            t = ShardedTrial.build(
                e.job,
                index=e.index,
                budget_bytes=self.cfg.device_budget_bytes,
                prefetch=self.cfg.prefetch,
            )
            if e.warm_start is not None:
                t.warm_start(e.warm_start)
            t.resume(e.checkpoint_dir)
            if self.processes:
                run.block = t.share()
            run.trial = t
        except Exception as exc:  # noqa: BLE001 - reported on the trial, the batch goes on
            return exc, traceback.format_exc()
        return None

    def _built(self, run: TrialRun, failed: tuple[Exception, str] | None) -> None:
        """A trial that could not be built fails; one already trained to its end succeeds."""
        if failed is not None:
            exc, trace = failed
            self._fail(run, f"{type(exc).__name__}: {exc}", trace)
        elif run.trial.step >= run.trial.steps_total:
            self._finish(run, "succeeded")

    # -- the scheduler's view --------------------------------------------------------------------

    def _step_time(self, run: TrialRun) -> float:
        """Measured mean mini-batch time, or an estimate from the trial's flops at the rate the
        measured trials achieve (before any is measured, a nominal rate: only the order matters)."""
        if run.step_times:
            return sum(run.step_times) / len(run.step_times)
        return run.trial.flops_per_step / (self._flops_rate or 1e10)

    def _idle(self, d: int) -> list[TrialRun]:
        return [
            r
            for r in self.runs.values()
            if r.status in ("pending", "running")
            and r.holder is None
            and r.pinned in (None, d)
            and not (r.stop_requested and r.trial.pos == 0)  # stops at the next poll instead
        ]

    def _view(self, run: TrialRun) -> TrialView:
        t = run.trial
        return TrialView(
            index=run.index,
            steps_left=t.steps_total - t.step,
            step_time_s=self._step_time(run),
            done_in_step_s=run.done_in_step_s,
            next_shard_bytes=t.work_bytes[t.next_task.shard],
            last_dispatch=run.last_dispatch,
        )

    def _pick(self, d: int, *, exclude: TrialRun | None = None, extra_bytes: int = 0) -> TrialRun | None:
        idle = [r for r in self._idle(d) if r is not exclude]
        if not idle:
            return None
        active = [r.index for r in self.runs.values() if r.status in ("pending", "running")]
        free = self.reservations[d].free_bytes()
        free = None if free is None else free - extra_bytes
        choice = None
        if self.rungs is not None:
            # trials that paused ones wait for go first (the policy still chooses among them)
            urgent = self.rungs.blocking()
            first = [self._view(r) for r in idle if r.index in urgent]
            if first:
                choice = self.scheduler.choose(first, active=active, free_bytes=free)
        if choice is None:
            choice = self.scheduler.choose([self._view(r) for r in idle], active=active, free_bytes=free)
        if choice is None:
            return None
        run = self.runs[choice.index]
        assert run.holder is None, f"trial {run.index} is already held by device {run.holder}"
        run.holder = d
        run.last_dispatch = self._dispatches
        self._dispatches += 1
        return run

    # -- stop signals ----------------------------------------------------------------------------

    def _poll_stops(self) -> None:
        now = time.monotonic()
        if now - self._last_poll < self.cfg.poll_s:
            return
        self._last_poll = now
        if not self._stopping and self.stop.requested():
            self._stopping = True
        wanted = self.stop_trials()
        for run in self.runs.values():
            if run.status in FINAL:
                continue
            if self._stopping or run.index in wanted:
                run.stop_requested = True
            # a trial between mini-batches and held by no device stops now; one mid-mini-batch
            # finishes it first (its shards would otherwise hold half an optimizer step)
            if run.stop_requested and run.holder is None and run.trial is not None and run.trial.pos == 0:
                self._finish(run, "stopped")

    # -- bookkeeping -----------------------------------------------------------------------------

    def _finish(self, run: TrialRun, status: Status) -> None:
        if status == "succeeded" and run.best_metric is None and is_user_metric(self.cfg.metric):
            # it would rank nowhere: a failure that says why
            self._fail(
                run,
                f"MetricNotReported: the batch ranks by {self.cfg.metric!r}, which this trial's code "
                f"never reported (trainer.report.report({self.cfg.metric!r}, value))",
            )
            return
        run.status = status
        t = run.trial
        steps = t.step if t is not None else 0
        ckpt = run.entry.checkpoint_dir
        if t is not None and ckpt is not None and steps > 0 and self.cfg.checkpoints != "none":
            path = t.save(ckpt)
            run.sink.event("checkpoint", {"step": steps, "path": str(path)})
        self._report_end(run, steps)
        self._keep_checkpoints(run)
        self._release(run)
        if self.rungs is not None:
            self._apply(self.rungs.finished(run.index, step=steps))

    def _release(self, run: TrialRun) -> None:
        """Under the lock: an ended trial's weights and optimizer state go (its result keeps its
        step and loss), in this process and, with device processes, in every device process that
        holds it (its shared block is unmapped there at the device's next dispatch), so memory
        follows the trials that run, however many the batch asks or ends. Nothing runs an ended
        trial again (rungs promote only paused trials). A trial still held by a device (its task
        running) is released when the device hands it back. With device threads, only a growing
        batch releases (its process lives as long as the batch)."""
        t = run.trial
        if t is None or run.released or run.holder is not None or not (self.more or self.processes):
            return
        run.released = True
        t.shards, t.model = [], torch.nn.Sequential()
        t._inputs.clear()
        t._y = t._grad = t._coef = None
        t._norms.clear()
        run.block = None
        if self._procs is not None:
            for d in range(len(self.devices)):
                if self._procs.knows(d, run.index):
                    self._forget[d].append(run.index)

    def _flush_forgets(self, d: int) -> None:
        """Device d's dispatch thread, between its orders: its process drops the ended trials."""
        if self._procs is not None and self._forget[d] and self.dead[d] is None:
            self._procs.forget(d, self._forget[d])
            self._forget[d] = []

    def _fail(self, run: TrialRun, error: str, trace: str = "") -> None:
        """The trial ends failed with `error` ("Type: message"); `trace` goes to its log."""
        run.error = error
        run.sink.log(f"trial {run.index} failed: {run.error}\n{trace}")
        run.status = "failed"
        steps = run.trial.step if run.trial else 0
        self._report_end(run, steps)
        self._keep_checkpoints(run)
        self._release(run)
        if self.rungs is not None:
            self._apply(self.rungs.finished(run.index, step=steps))

    def _report_end(self, run: TrialRun, steps: int) -> None:
        """The trial's result, then its final event (both say why it stopped)."""
        result = self._result(run)
        run.sink.result(result)
        data: dict[str, Any] = {"status": run.status, "steps_done": steps}
        if run.stop_reason is not None:
            data["stop_reason"] = result["stop_reason"]
        if run.error is not None:
            data["error"] = run.error
        run.sink.event("trial", data)

    def _keep_checkpoints(self, run: TrialRun) -> None:
        """Apply the checkpoint policy to an ended trial: `none` removes its directory, `best`
        keeps only the best ended trial's (by the leaderboard's rule), `all` keeps every one."""
        policy = self.cfg.checkpoints
        if policy == "all" or run.entry.checkpoint_dir is None:
            return
        if policy == "best" and run.best_metric is not None:
            kept = self.runs[self._kept] if self._kept is not None else None
            sign = 1.0 if self.cfg.mode == "min" else -1.0
            if kept is None or (sign * run.best_metric, run.index) < (sign * kept.best_metric, kept.index):
                self._kept = run.index
                run = kept  # the previous best loses its place
            if run is None:
                return
        shutil.rmtree(run.entry.checkpoint_dir, ignore_errors=True)

    def _apply(self, decisions: Decisions) -> None:
        for i in decisions.promoted:
            run = self.runs[i]
            if run.status == "paused":
                run.status = "running"
        for i in decisions.stopped:
            run = self.runs[i]
            if run.status not in FINAL:
                run.stop_reason = decisions.reasons.get(i)
                self._finish(run, "stopped_early")

    def _result(self, run: TrialRun) -> dict[str, Any]:
        t = run.trial
        return {
            "trial": run.index,
            "status": run.status,
            "steps": t.step if t else 0,
            "final_loss": t.loss if t else float("nan"),
            "val_loss": run.val_loss,
            "metric": self.cfg.metric,
            "last_metric": run.last_metric,
            "best_metric": run.best_metric,
            "stopped_early": run.status == "stopped_early",
            "stop_reason": None if run.stop_reason is None else run.stop_reason.as_dict(),
            "error": run.error,
            "compute_s": run.compute_s,
            "copy_s": run.copy_s,
            "busy_s": run.busy_s,
            "overhead_s": run.dispatch_s + run.busy_s - run.compute_s - (run.copy_s - run.prefetch_s),
            "prefetch_s": run.prefetch_s,
        }

    def _unreported(self, loss: float) -> float:
        """A rung's value for a trial with no metric yet: its loss for a built-in metric, the worst
        value there is for a user's own (a trial that never reports it ranks last)."""
        if not is_user_metric(self.cfg.metric):
            return loss
        return math.inf if self.cfg.mode == "min" else -math.inf

    def _better(self, a: float, b: float | None) -> bool:
        return b is None or (a < b if self.cfg.mode == "min" else a > b)

    # -- the device worker -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _on(self, d: int) -> Iterator[None]:
        if self.devices[d].type == "cuda":
            with torch.cuda.device(self.devices[d]):
                yield
        else:
            yield

    def _prefetch(self, d: int, run: TrialRun) -> None:
        """Start copying `run`'s next shard to device d: on CUDA on the device's copy stream, so it
        overlaps the task about to run; on a CPU thread the same call binds the host copy at once.
        A device process binds it when the task comes (host and device are one memory there)."""
        run.prefetches += 1
        if self._procs is not None:
            return
        t = run.trial
        task = t.next_task
        dt = t.copy_in(task.shard, self.places[d], state=task.steps, grads=task.kind == "S")
        run.copy_s += dt
        run.prefetch_s += dt

    def _worker(self, d: int) -> None:
        try:
            self._work(d)
        except BaseException as exc:  # a bug in the executor itself: stop every device, re-raise in run()
            with self._cond:
                self._fatal = self._fatal or exc
                self._cond.notify_all()
            raise

    def _work(self, d: int) -> None:
        booked = self.reservations[d]
        reserved: TrialRun | None = None
        ahead: Order | None = None
        """Device processes: the order already sent for `reserved` (see _send_ahead)."""
        with self._on(d):
            while True:
                t_free = time.perf_counter()
                waited = 0.0
                with self._cond:
                    run = None
                    while run is None:
                        if self._fatal is not None:
                            return
                        self._poll_stops()
                        self._flush_forgets(d)
                        if reserved is not None:
                            run, reserved = reserved, None
                            booked.release((run.index, "prefetch"))
                            # an order sent ahead is in the device's pipe: it runs as sent
                            if ahead is None and run.stop_requested and run.trial.pos == 0:
                                if self._procs is None:
                                    run.trial.shards[run.trial.next_task.shard].spill()
                                run.holder = None
                                self._finish(run, "stopped")
                                run = None
                                continue
                        else:
                            run = self._pick(d)
                        if run is None and self._may_ask():
                            a0 = time.perf_counter()
                            self._ask_more()
                            asked = time.perf_counter() - a0
                            self.ask_s[d] += asked
                            waited += asked
                            continue
                        if run is None:
                            if all(r.status in FINAL for r in self.runs.values()) and not self._growing():
                                self.idle_s[d] += waited  # the tail: waiting for the last trials
                                self._cond.notify_all()
                                return
                            self._waiting += 1
                            w0 = time.perf_counter()
                            self._cond.wait(timeout=self.cfg.poll_s)
                            waited += time.perf_counter() - w0
                            self._waiting -= 1
                    t = run.trial
                    k = t.next_task.shard
                    booked.reserve((run.index, "run"), t.work_bytes[k])
                    if not run.started:
                        run.started = True
                        run.status = "running"
                        run.sink.event("trial", {"status": "running", "steps_done": t.step})
                    nxt = None
                    # reserve the next trial only when no device is waiting for work, so a
                    # reservation never keeps a free device idle; and not for a growing batch on
                    # device processes: there a reservation copies nothing ahead (one memory), and
                    # with the few trials a sampler keeps in flight it pins two of them to this
                    # device while another has one to itself, so the trial with the least work left
                    # runs on and the batch's last trials end apart (longest first, they end together)
                    if self.cfg.prefetch and self._waiting == 0 and not (self.processes and self.more):
                        nxt = self._pick(d, exclude=run)
                        if nxt is not None:
                            nt = nxt.trial
                            booked.reserve((nxt.index, "prefetch"), nt.copy_bytes[nt.next_task.shard])
                t_slot = time.perf_counter()
                run.dispatch_s += t_slot - t_free - waited
                self.idle_s[d] += waited
                t_pf = 0.0
                if nxt is not None:
                    self._prefetch(d, nxt)
                    t_pf = time.perf_counter() - t_slot
                sent, ahead = ahead, None

                def then(nxt: TrialRun | None = nxt) -> None:
                    nonlocal ahead
                    ahead = self._send_ahead(d, nxt)

                self._run_task(d, run, sent=sent, then=then)
                with self._cond:
                    booked.release((run.index, "run"))
                    self._after_task(run)
                    run.busy_s += time.perf_counter() - t_slot - t_pf
                    if self.dead[d] is not None:
                        # its reservation goes back; the trial itself is whole (an order sent
                        # ahead never started: the process died before it ended the one before)
                        if nxt is not None:
                            booked.release((nxt.index, "prefetch"))
                            nxt.holder = None
                        self._cond.notify_all()
                        return
                    self._cond.notify_all()
                reserved = nxt

    # -- trials added while the batch runs ------------------------------------------------------

    def _ended(self) -> int:
        return sum(r.status in FINAL for r in self.runs.values())

    def _may_ask(self) -> bool:
        """Under the lock: whether this free device should ask `more` now."""
        return (
            self.more is not None
            and not self._asking
            and not self._stopping
            and self._asked_at != self._ended()
        )

    def _growing(self) -> bool:
        """Under the lock: whether `more` may still add a trial (it is being asked, or a trial ended
        since it last had none)."""
        if self.more is None:
            return False
        return self._asking or (not self._stopping and self._asked_at != self._ended())

    def _ask_more(self) -> None:
        """Under the lock (released while `more` answers and the trials are built): ask for the
        trials due now (a list; a lone TrialEntry or None read as one or none)."""
        assert self.more is not None
        self._asking = True
        ended = self._ended()
        self._cond.release()
        built: list[tuple[TrialRun, tuple[Exception, str] | None]] = []
        try:
            got = self.more()
            for entry in got:
                run = TrialRun(entry=entry)
                built.append((run, self._cut(run)))
        finally:
            self._cond.acquire()
            self._asking = False
            self._cond.notify_all()
        if not built:
            self._asked_at = ended
            return
        for run, exc in built:
            self._join(run, exc)

    def _order(self, d: int, run: TrialRun, *, chunk: bool = False) -> Order:
        """The task for device d, with whether the trial evaluates once it ends its mini-batch; with
        `chunk`, the tasks after it too, up to the next point where this process must act on the
        trial: an evaluation, a rung, a checkpoint, its last step, a stop it was asked for (or
        `chunk_tasks`). Between those points the parent only reports (the same metrics, in the same
        order, from each task's Done)."""
        t = run.trial
        after = AfterStep.of(t.job)
        ckpt = run.entry.checkpoint_dir
        limit = self.cfg.chunk_tasks if chunk else 1
        evaluates: list[bool] = []
        step, pos = t.step, t.pos
        while len(evaluates) < limit:
            if pos < len(t.tasks) - 1:
                evaluates.append(False)
                pos += 1
                continue
            step, pos = step + 1, 0
            # an ASHA rung ranked by val_loss needs one at that step too
            rung = self.rungs is not None and self.rungs.is_rung(run.index, step)
            # (a user's metric may be one its evaluation reports)
            evaluates.append(after.evaluates(step) or (rung and self.cfg.metric != "loss"))
            if (
                evaluates[-1]
                or rung
                or step >= t.steps_total
                or run.stop_requested
                or (ckpt is not None and after.checkpoints(step))
            ):
                break
        order = Order(trial=run.index, step=t.step, pos=t.pos, loss=t.loss, evaluates=evaluates)
        if self._procs is not None and not self._procs.knows(d, run.index):
            assert run.block is not None
            order.adopt = Adoption(
                job=run.entry.job,
                block=run.block,
                budget_bytes=self.cfg.device_budget_bytes,
                prefetch=self.cfg.prefetch,
            )
        return order

    def _lone(self, d: int, run: TrialRun) -> bool:
        """Under the lock: nothing but `run` could use device d now (no other trial waits for a
        device, `more` is not due), so its next tasks may go in one order."""
        return (
            self._fatal is None
            and not self._stopping
            and not run.stop_requested
            and not any(r is not run for r in self._idle(d))
            and not self._may_ask()
        )

    def _should_cut(self, d: int, run: TrialRun) -> bool:
        """While `run`'s chunk runs on device d (asked every poll_s): end it at the next task, since
        a stop was asked or another trial now waits for a device."""
        with self._cond:
            self._poll_stops()
            return not self._lone(d, run)

    def _send_ahead(self, d: int, nxt: TrialRun | None) -> Order | None:
        """Device processes, once device d's one-task order is on its pipe (or as a chunk's last
        task ends): send the order of `nxt`, the trial this device reserved to run next, behind
        it, so the process starts it the moment the running one ends instead of waiting for this
        process to wake, book that one and choose (a round trip per task: a median 5 ms of each
        ~25 ms step on 2 busy cores, and a wait for a core on a loaded machine). The same order
        as it would get later: one task, from `nxt`'s own state (which nothing else changes while
        this device holds it; rung decisions only stop paused trials). None (sent the usual way
        later) for no `nxt`, a stop asked, or a gone pipe."""
        if nxt is None or self._procs is None or not self.cfg.send_ahead:
            return None
        with self._cond:
            self._poll_stops()
            if self._fatal is not None or nxt.stop_requested or nxt.status not in ("pending", "running"):
                return None
            order = self._order(d, nxt)
        if not self._procs.send(d, order):
            return None
        with self._cond:
            nxt.orders += 1
            self.orders_ahead += 1
        return order

    def _run_task(
        self,
        d: int,
        run: TrialRun,
        *,
        sent: Order | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Run `run`'s next task (or chunk) on device d and book it. Device processes: `sent` is
        its order when it was sent ahead (_send_ahead); `then` is called once a one-task order is
        on the pipe (so the next one waits behind it in the pipe), or as a chunk's last task
        ends, before it is booked."""
        t = run.trial
        if self._procs is None:
            task = t.next_task
            order = self._order(d, run)
            self._apply_done(d, run, task, execute(t, self.places[d], evaluate=order.evaluates[0]))
            return
        if sent is not None:
            order = sent
        else:
            with self._cond:
                order = self._order(d, run, chunk=self.cfg.chunk_tasks > 1 and self._lone(d, run))
            run.orders += 1
        stateful = run.entry.job.data.kind == "python"  # the data iterator lives in that process
        going = True
        try:
            # each task's Done as it ends, in order, booked as if it had been its own order: a
            # chunk's metrics go out step by step, and a process that dies mid-chunk has had the
            # steps it finished booked
            for done in self._procs.run(
                d,
                order,
                cut=lambda: self._should_cut(d, run),
                poll_s=self.cfg.poll_s,
                sent=sent is not None,
                on_sent=then if len(order.evaluates) == 1 else None,
                on_last=then if len(order.evaluates) > 1 else None,
            ):
                if not going:
                    continue  # the trial failed here: the rest of the chunk comes off the pipe unbooked
                task = t.next_task
                # the parent's record of the trial follows the device's (its tensors are shared)
                t.step, t.pos, t.loss = done.step, done.pos, done.loss
                ledger = self.places[d].ledger
                ledger.peak, ledger.held = max(ledger.peak, done.peak_bytes), done.held_bytes
                run.pinned = d if (t.pos != 0 or stateful) else None
                if not self._apply_done(d, run, task, done):
                    going = False
                    self._procs.cut(d)
        except DeviceDied as exc:
            task = t.next_task
            self._device_died(d, run, f"{exc} while running the trial's task {task.kind}{task.shard}")

    def _apply_done(self, d: int, run: TrialRun, task: Any, done: Done) -> bool:
        """Book one task's Done: its timings and slot, at a mini-batch end the metrics, evaluation
        and checkpoint; a failure fails the trial. Returns whether the trial goes on."""
        t = run.trial
        if done.ran:
            run.compute_s += done.compute_s
            run.copy_s += done.copy_s
            run.done_in_step_s += done.compute_s + done.copy_s
            with self._cond:
                self.trace.append(
                    Slot(
                        trial=run.index,
                        device=d,
                        kind=task.kind,
                        shard=task.shard,
                        start=done.start,
                        end=done.end,
                        compute_s=done.compute_s,
                        copy_s=done.copy_s,
                    )
                )
        if done.reports:
            run.reports.merge(done.reports)
        try:
            if done.ran and t.pos == 0:  # the mini-batch is done: metrics, evaluation, checkpoint
                self._end_of_step(run, done)
        except Exception as exc:  # noqa: BLE001 - this trial fails, the batch goes on
            done.error = done.error or f"{type(exc).__name__}: {exc}"
            done.trace = done.trace or traceback.format_exc()
        if done.error is not None:
            with self._cond:
                self._fail(run, done.error, done.trace)
            return False
        return True

    def _device_died(self, d: int, run: TrialRun, error: str) -> None:
        """Device d's process is gone: fail its trial and every trial whose mini-batch (or data)
        lived there; with no device left, fail the rest too. The other devices go on."""
        with self._cond:
            self.dead[d] = error
            self._fail(run, f"DeviceDied: {error}")
            for r in self.runs.values():
                if r is not run and r.status not in FINAL and r.pinned == d:
                    self._fail(r, f"DeviceDied: {error} (this trial's mini-batch was in that process)")
            if all(self.dead):
                for r in self.runs.values():
                    if r is not run and r.status not in FINAL and r.holder in (None, d):
                        self._fail(r, f"DeviceDied: no device left ({'; '.join(map(str, self.dead))})")
            self._cond.notify_all()

    def _end_of_step(self, run: TrialRun, done: Done) -> None:
        t = run.trial
        step = t.step
        cfg = t.job.train
        run.step_times.append(run.done_in_step_s)
        sink = run.sink
        report_step(
            sink,
            step=step,
            loss=t.loss,
            seconds=run.done_in_step_s,
            tokens=cfg.batch_size * t.job.model.seq_len,
            peak_mem_mb=done.peak_bytes / 2**20,
        )
        run.done_in_step_s = 0.0
        if done.val_loss is not None:
            run.compute_s += done.eval_s
            run.val_loss = done.val_loss
            report_eval(sink, step=step, val_loss=run.val_loss)
            if self.cfg.metric == "val_loss":
                self._record(run, run.val_loss)
        if done.error is not None:  # the evaluation failed
            return
        values = emit(sink, step=step, reports=run.reports, names=run.names)
        if self.cfg.metric == "loss":
            self._record(run, t.loss)
        elif self.cfg.metric in values:
            self._record(run, values[self.cfg.metric])
        ckpt = run.entry.checkpoint_dir
        # the last step's checkpoint is _finish's
        if ckpt is not None and AfterStep.of(t.job).checkpoints(step):
            sink.event("checkpoint", {"step": step, "path": str(t.save(ckpt))})

    def _record(self, run: TrialRun, value: float) -> None:
        run.last_metric = value
        if self._better(value, run.best_metric):
            run.best_metric = value

    def _after_task(self, run: TrialRun) -> None:
        """Under the lock: hand the trial back, take ASHA's decision at a mini-batch end."""
        run.holder = None
        if run.status in FINAL:  # failed inside the task, or ended while it ran
            self._release(run)
            return
        t = run.trial
        if t.pos != 0:
            return
        measured = [r for r in self.runs.values() if r.step_times]
        self._flops_rate = sum(r.trial.flops_per_step * len(r.step_times) for r in measured) / sum(
            sum(r.step_times) for r in measured
        )
        if t.step >= t.steps_total:
            self._finish(run, "succeeded")
            return
        if run.stop_requested:
            self._finish(run, "stopped")
            return
        if self.rungs is not None and self.rungs.is_rung(run.index, t.step):
            value = run.last_metric if run.last_metric is not None else self._unreported(t.loss)
            run.status = "paused"
            self._apply(self.rungs.report(run.index, step=t.step, value=value))

    # -- run -------------------------------------------------------------------------------------

    def run(self) -> dict[int, dict[str, Any]]:
        """Train every trial to its end (or its stop); returns each trial's result by index."""
        self._started = True
        self.marks["prepare"] = time.time()
        self._prepare()
        self.marks["built"] = time.time()
        if self.processes:
            # forked now, before any thread of ours runs: the processes inherit the built trials
            # (their tensors already in shared memory) and the trials added later are handed over
            trials = {
                i: r.trial for i, r in self.runs.items() if r.trial is not None and r.status not in FINAL
            }
            labels = [f"{d}#{i}" for i, d in enumerate(self.devices)]
            self._procs = DeviceProcesses(
                labels,
                trials=trials,
                budget_bytes=self.cfg.device_budget_bytes,
                after_fork=self.runs.clear,  # in a child: only `trials` holds them there
            )
        threads = [
            threading.Thread(target=self._worker, args=(d,), name=f"selection-dev{d}", daemon=True)
            for d in range(len(self.devices))
        ]
        self.marks["devices"] = time.time()
        try:
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            if self._procs is not None:
                self._procs.close()
            self.marks["ended"] = time.time()
        if self._fatal is not None:
            raise RuntimeError(f"selection executor failed: {self._fatal!r}") from self._fatal
        return {i: self._result(r) for i, r in sorted(self.runs.items())}
