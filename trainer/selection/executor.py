"""Shard alternation over a node's devices: the selection batch's executor.

One worker thread per device. A free device asks the policy (trainer/selection/policy.py)
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

Threading: every piece of shared state (trial status, holders, ledgers, ASHA) is the `Batch`'s
(trainer/selection/trial_run.py) and changes under its `cond`; a trial's tensors are touched only
by the device that holds it, outside the lock.

CPU devices are processes (trainer/selection/devices.py): each device thread here stays the
device's dispatcher, every decision stays in this process, and the task itself runs in the
device's forked process on the trial's tensors in shared memory. There a trial changes device only
between mini-batches (its boundary activations live in the process that began the mini-batch).
CUDA devices stay threads: CUDA cannot be forked once initialised.

This module builds the trials and runs each device's loop (wait for a trial, dispatch it, run its
task, hand it back); the parts it drives each own one concern, over the shared `Batch`:
- dispatch.py: which idle trial a free device takes (the policy's view of each trial);
- timing.py: a trial's mini-batch cost for that view, and where a device's time goes in a slot;
- prefetch.py: the trial a device reserves to run next, and the copy of its next shard;
- device_tasks.py: running a task, in place or as an order to a device process (chunks for a
  lone trial, the next order sent ahead, ended trials dropped);
- device_deaths.py: a device process that dies, and the trials that die with it;
- booking.py: a finished task's timings, metrics, evaluation and checkpoint, and the rungs;
- trial_ends.py: how a trial ends (result, checkpoint policy, release of its memory);
- stops.py and growth.py: what comes from outside while it runs (stop signals, `more`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.protocol import NeverStop, StopSignal
from trainer.selection.booking import Booking
from trainer.selection.device_deaths import DeadDevices
from trainer.selection.device_tasks import DeviceTasks, Forgets
from trainer.selection.devices import DeviceProcesses, Order
from trainer.selection.dispatch import Dispatcher
from trainer.selection.executor_config import ExecutorConfig, uses_processes
from trainer.selection.growth import Growth
from trainer.selection.halving import Halving
from trainer.selection.policy import Policy, make_policy
from trainer.selection.prefetch import Prefetch
from trainer.selection.reservations import Reservations
from trainer.selection.shards import Place, ShardedTrial
from trainer.selection.stops import Stops
from trainer.selection.timing import SlotTimer, StepTimes
from trainer.selection.trial_ends import Ends
from trainer.selection.trial_run import FINAL, Batch, BuildError, Slot, Status, TrialEntry, TrialRun
from trainer.spill.ledger import DeviceLedger

__all__ = [
    "FINAL",
    "Executor",
    "ExecutorConfig",
    "Slot",
    "Status",
    "TrialEntry",
    "TrialRun",
    "uses_processes",
]


def _check(
    entries: list[TrialEntry],
    *,
    devices: list[torch.device],
    cfg: ExecutorConfig,
    more: Callable[[], list[TrialEntry]] | None,
) -> None:
    if not devices:
        raise ValueError("a selection batch needs at least one device")
    if cfg.device_processes and not all(d.type == "cpu" for d in devices):
        raise ValueError(
            f"device processes are for CPU devices only (CUDA cannot be forked once initialised), "
            f"got {', '.join(map(str, devices))}"
        )
    if len({e.index for e in entries}) != len(entries):
        raise ValueError("trial indices must be unique")
    if more is not None and cfg.early_stopping is not None:
        raise ValueError("a batch that grows as it runs (more) cannot have early stopping rungs")


class Executor:
    def __init__(
        self,
        entries: list[TrialEntry],
        *,
        devices: list[torch.device],
        cfg: ExecutorConfig,
        stop: StopSignal | None = None,
        stop_trials: Callable[[], set[int]] | None = None,
        policy: Policy | None = None,
        more: Callable[[], list[TrialEntry]] | None = None,
    ) -> None:
        _check(entries, devices=devices, cfg=cfg, more=more)
        self.cfg = cfg
        self.devices = devices
        self.processes = uses_processes(cfg, devices)
        """CPU devices run as processes (trainer/selection/devices.py)."""
        runs = {e.index: TrialRun(entry=e) for e in entries}
        self.batch = Batch(cfg=cfg, runs=runs, processes=self.processes, grows=more is not None)
        self.runs = self.batch.runs
        self.trace: list[Slot] = self.batch.trace
        self.reservations = [
            Reservations(device=f"{d}#{i}", budget_bytes=cfg.device_budget_bytes)
            for i, d in enumerate(devices)
        ]
        budget = cfg.device_budget_bytes
        # the real bytes on each device (the spilling engine's ledger; strict: passing the budget
        # raises), beside `self.reservations`, the policy's plan
        self.places = [
            Place(
                device=d,
                ledger=DeviceLedger(budget_bytes=budget, strict=budget is not None),
                stream=torch.cuda.Stream(device=d) if d.type == "cuda" and cfg.prefetch else None,
            )
            for d in devices
        ]
        self.idle_s = [0.0] * len(devices)
        """Per device: time it had no trial to run before the batch's end (waiting for one, or
        asking `more` for one)."""
        self.ask_s = [0.0] * len(devices)
        """Per device: of idle_s, the time spent asking `more` (a growing batch)."""
        self.marks: dict[str, float] = {}
        """When `run` reached each phase (Unix seconds): `prepare` (it began building the trials on
        the host), `built`, `devices` (the device processes forked; with threads, when they start),
        `ended` (every device done, the device processes closed)."""
        self._procs: DeviceProcesses | None = None
        self._started = False
        self._wire(
            policy or make_policy(cfg.scheduler),
            stop=stop or NeverStop(),
            stop_trials=stop_trials or (lambda: set()),
            more=more,
        )

    def _wire(
        self,
        policy: Policy,
        *,
        stop: StopSignal,
        stop_trials: Callable[[], set[int]],
        more: Callable[[], list[TrialEntry]] | None,
    ) -> None:
        """The executor's parts, each over the shared batch."""
        b, n = self.batch, len(self.devices)
        self.forgets = Forgets(devices=n)
        self.ends = Ends(b, forget=self.forgets.note)
        costs = StepTimes()
        self.stops = Stops(batch=b, ends=self.ends, stop=stop, stop_trials=stop_trials)
        self.dispatcher = Dispatcher(batch=b, policy=policy, reservations=self.reservations, costs=costs)
        self.growth = Growth(batch=b, more=more, cut=self._cut, join=self._join)
        self.booking = Booking(b, self.ends, costs=costs)
        self.deaths = DeadDevices(b, self.ends, devices=n)
        self.dead = self.deaths.dead
        """Per device: why its process died (device processes only), or None while it serves."""
        self.tasks = DeviceTasks(
            batch=b,
            places=self.places,
            booking=self.booking,
            deaths=self.deaths,
            dispatcher=self.dispatcher,
            growth=self.growth,
            stops=self.stops,
        )

    @property
    def orders_ahead(self) -> int:
        """Device processes: orders sent ahead (DeviceTasks.send_ahead), of all the trials' `orders`."""
        return self.tasks.orders_ahead

    # -- set-up ----------------------------------------------------------------------------------

    def add_trial(self, entry: TrialEntry) -> TrialRun:
        """Add a trial, before `run` or while it runs (from this process: a device thread, a
        sink); a free device takes it like any other. Device processes get it with its first task.
        Trials that early stopping ranks must all be known when the run starts."""
        with self.batch.cond:
            if self.batch.rungs is not None:
                raise ValueError("trials cannot join a batch with early stopping once it has started")
            run = TrialRun(entry=entry)
            self._join(run, self._cut(run) if self._started else None)
            self.batch.cond.notify_all()
        return run

    def _join(self, run: TrialRun, failed: BuildError | None) -> None:
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
            self._built(run, self._cut(run))
        max_steps = {i: r.entry.job.train.steps for i, r in self.runs.items()}
        if self.cfg.early_stopping is not None:
            rungs = self.batch.rungs = Halving(self.cfg.early_stopping, max_steps=max_steps)
            for run in self.runs.values():
                if run.status in FINAL:
                    rungs.finished(run.index, step=run.trial.step if run.trial else 0)
                elif run.trial.step > 0:
                    rungs.resumed(run.index, step=run.trial.step)

    def _cut(self, run: TrialRun) -> BuildError | None:
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

    def _built(self, run: TrialRun, failed: BuildError | None) -> None:
        """A trial that could not be built fails; one already trained to its end succeeds."""
        if failed is not None:
            exc, trace = failed
            self.ends.fail(run, f"{type(exc).__name__}: {exc}", trace)
        elif run.trial.step >= run.trial.steps_total:
            self.ends.finish(run, "succeeded")

    # -- run -------------------------------------------------------------------------------------

    def run(self) -> dict[int, dict[str, Any]]:
        """Train every trial to its end (or its stop); returns each trial's result by index."""
        self._started = True
        self.marks["prepare"] = time.time()
        self._prepare()
        self.marks["built"] = time.time()
        if self.processes:
            self._fork()
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
        if (fatal := self.batch.fatal) is not None:
            raise RuntimeError(f"selection executor failed: {fatal!r}") from fatal
        return {i: self.ends.result(r) for i, r in sorted(self.runs.items())}

    def _fork(self) -> None:
        """Fork the device processes now, before any thread of ours runs: they inherit the built
        trials (their tensors already in shared memory) and the trials added later are handed
        over."""
        trials = {i: r.trial for i, r in self.runs.items() if r.trial is not None and r.status not in FINAL}
        labels = [f"{d}#{i}" for i, d in enumerate(self.devices)]
        self._procs = DeviceProcesses(
            labels,
            trials=trials,
            budget_bytes=self.cfg.device_budget_bytes,
            after_fork=self.runs.clear,  # in a child: only `trials` holds them there
        )
        self.forgets.procs = self.tasks.procs = self._procs

    # -- the device worker -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _on(self, d: int) -> Iterator[None]:
        if self.devices[d].type == "cuda":
            with torch.cuda.device(self.devices[d]):
                yield
        else:
            yield

    def _worker(self, d: int) -> None:
        try:
            self._work(d)
        except BaseException as exc:  # a bug in the executor itself: stop every device, re-raise in run()
            with self.batch.cond:
                self.batch.fatal = self.batch.fatal or exc
                self.batch.cond.notify_all()
            raise

    def _work(self, d: int) -> None:
        lane = Prefetch(
            batch=self.batch,
            d=d,
            dispatcher=self.dispatcher,
            ends=self.ends,
            booked=self.reservations[d],
            place=self.places[d],
            threads=self._procs is None,
        )
        with self._on(d):
            while self._slot(d, lane):
                pass

    def _slot(self, d: int, lane: Prefetch) -> bool:
        """One slot of device d: wait for a trial, dispatch it (and reserve the next one), run its
        task, hand it back. False: the device is done."""
        cond = self.batch.cond
        timer = SlotTimer()
        with cond:
            run = self._next_run(d, lane, timer)
            if run is None:
                return False
            nxt = self._dispatch(d, run, lane)
        timer.begin(run)
        self.idle_s[d] += timer.waited
        if nxt is not None:
            lane.copy(nxt)
            timer.prefetched()
        sent, lane.ahead = lane.ahead, None

        def then() -> None:
            lane.ahead = self.tasks.send_ahead(d, nxt)

        self._run_task(d, run, sent=sent, then=then)
        with cond:
            self.reservations[d].release((run.index, "run"))
            self.booking.hand_back(run)
            timer.end(run)
            if not self.deaths.serves(d):
                lane.drop(nxt)
                cond.notify_all()
                return False
            cond.notify_all()
        lane.reserved = nxt
        return True

    def _run_task(
        self, d: int, run: TrialRun, *, sent: Order | None = None, then: Callable[[], None] | None = None
    ) -> None:
        """Run `run`'s next task on device d and book it (DeviceTasks.run), outside the lock: the
        one place a subclass may change what a device thread does around each task (the tests
        delay it at random, to vary the interleaving)."""
        self.tasks.run(d, run, sent=sent, then=then)

    def _next_run(self, d: int, lane: Prefetch, timer: SlotTimer) -> TrialRun | None:
        """Under the lock: the trial device d runs next (its reserved one, else the policy's
        choice), asking `more` or waiting while there is none; None once the device is done (every
        trial ended and `more` has none, or the executor failed)."""
        b = self.batch
        while True:
            if b.fatal is not None:
                return None
            self.stops.poll()
            if self.deaths.serves(d):
                self.forgets.flush(d)
            if lane.reserved is not None:
                run = lane.take()
                if run is None:
                    continue
            else:
                run = self.dispatcher.pick(d)
            if run is not None:
                return run
            if self.growth.may_ask():
                a0 = time.perf_counter()
                self.growth.ask()
                self.ask_s[d] += timer.waited_since(a0)
                continue
            if all(r.status in FINAL for r in self.runs.values()) and not self.growth.growing():
                self.idle_s[d] += timer.waited  # the tail: waiting for the last trials
                b.cond.notify_all()
                return None
            b.waiting += 1
            w0 = time.perf_counter()
            b.cond.wait(timeout=self.cfg.poll_s)
            timer.waited_since(w0)
            b.waiting -= 1

    def _dispatch(self, d: int, run: TrialRun, lane: Prefetch) -> TrialRun | None:
        """Under the lock: device d takes `run` (its next shard's bytes booked; its first task
        announced); returns the trial reserved to run after it, if any."""
        t = run.trial
        self.reservations[d].reserve((run.index, "run"), t.work_bytes[t.next_task.shard])
        if not run.started:
            run.started = True
            run.status = "running"
            run.sink.event("trial", {"status": "running", "steps_done": t.step})
        return lane.choose(run)
