"""Running a selection trial's next task on a device and booking what it did. A device thread runs
it in place; a device process (trainer/selection/devices.py) gets it as an order over its pipe:
several tasks at once for a lone trial (cut short when another trial comes to wait or a stop is
asked), the next trial's order sent ahead of time, ended trials dropped between orders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.after_step import AfterStep
from trainer.selection.booking import Booking
from trainer.selection.device_deaths import DeadDevices
from trainer.selection.devices import Adoption, DeviceDied, DeviceProcesses, Order, execute
from trainer.selection.dispatch import Dispatcher
from trainer.selection.executor_config import ExecutorConfig
from trainer.selection.growth import Growth
from trainer.selection.halving import Halving
from trainer.selection.shards import Place
from trainer.selection.stops import Stops
from trainer.selection.trial_run import Batch, TrialRun


class Forgets:
    """Device processes: the ended trials each process still holds, dropped between its orders."""

    def __init__(self, *, devices: int) -> None:
        self.procs: DeviceProcesses | None = None
        """Set once the device processes are forked; None: device threads."""
        self._pending: list[list[int]] = [[] for _ in range(devices)]

    def note(self, index: int) -> None:
        """Under the lock: trial `index` has ended and was released here."""
        if self.procs is None:
            return
        for d, pending in enumerate(self._pending):
            if self.procs.knows(d, index):
                pending.append(index)

    def flush(self, d: int) -> None:
        """Device d's dispatch thread, between its orders: its process drops the ended trials."""
        if self.procs is not None and self._pending[d]:
            self.procs.forget(d, self._pending[d])
            self._pending[d] = []


def evaluations(run: TrialRun, *, rungs: Halving | None, metric: str, limit: int) -> list[bool]:
    """The next tasks of `run` one order carries (at most `limit`), each with whether the trial
    evaluates once it ends its mini-batch: up to the next point where this process must act on
    the trial (an evaluation, a rung, a checkpoint, its last step, a stop it was asked for)."""
    t = run.trial
    after = AfterStep.of(t.job)
    ckpt = run.entry.checkpoint_dir
    evaluates: list[bool] = []
    step, pos = t.step, t.pos
    while len(evaluates) < limit:
        if pos < len(t.tasks) - 1:
            evaluates.append(False)
            pos += 1
            continue
        step, pos = step + 1, 0
        # an ASHA rung ranked by val_loss needs one at that step too
        rung = rungs is not None and rungs.is_rung(run.index, step)
        # (a user's metric may be one its evaluation reports)
        evaluates.append(after.evaluates(step) or (rung and metric != "loss"))
        if (
            evaluates[-1]
            or rung
            or step >= t.steps_total
            or run.stop_requested
            or (ckpt is not None and after.checkpoints(step))
        ):
            break
    return evaluates


@dataclass(kw_only=True, slots=True, eq=False)
class DeviceTasks:
    batch: Batch
    places: list[Place]
    booking: Booking
    deaths: DeadDevices
    dispatcher: Dispatcher
    """Whether another trial waits for a device (a chunk is cut for it)."""
    growth: Growth
    """Whether `more` is due (a chunk is cut for it too)."""
    stops: Stops
    procs: DeviceProcesses | None = None
    """Set once the device processes are forked; None: device threads."""
    orders_ahead: int = field(default=0, init=False)
    """Device processes: orders sent ahead (send_ahead), of all the trials' `orders`."""

    @property
    def cfg(self) -> ExecutorConfig:
        return self.batch.cfg

    def order(self, d: int, run: TrialRun, *, chunk: bool = False) -> Order:
        """The task for device d (under the lock with device processes), with whether the trial evaluates once it ends
        its mini-batch; with `chunk`, the tasks after it too (evaluations: up to `chunk_tasks`).
        Between those points the parent only reports (the same metrics, in the same order, from
        each task's Done)."""
        t = run.trial
        limit = self.cfg.chunk_tasks if chunk else 1
        evaluates = evaluations(run, rungs=self.batch.rungs, metric=self.cfg.metric, limit=limit)
        order = Order(trial=run.index, step=t.step, pos=t.pos, loss=t.loss, evaluates=evaluates)
        if self.procs is not None and not self.procs.knows(d, run.index):
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
            self.batch.fatal is None
            and not self.batch.stopping
            and not run.stop_requested
            and not any(r is not run for r in self.dispatcher.idle(d))
            and not self.growth.may_ask()
        )

    def _should_cut(self, d: int, run: TrialRun) -> bool:
        """While `run`'s chunk runs on device d (asked every poll_s): end it at the next task, since
        a stop was asked or another trial now waits for a device."""
        with self.batch.cond:
            self.stops.poll()
            return not self._lone(d, run)

    def send_ahead(self, d: int, nxt: TrialRun | None) -> Order | None:
        """Device processes, once device d's one-task order is on its pipe (or as a chunk's last
        task ends): send the order of `nxt`, the trial this device reserved to run next, behind
        it, so the process starts it the moment the running one ends instead of waiting for this
        process to wake, book that one and choose (a round trip per task: a median 5 ms of each
        ~25 ms step on 2 busy cores, and a wait for a core on a loaded machine). The same order
        as it would get later: one task, from `nxt`'s own state (which nothing else changes while
        this device holds it; rung decisions only stop paused trials). None (sent the usual way
        later) for no `nxt`, a stop asked, or a gone pipe."""
        if nxt is None or self.procs is None or not self.cfg.send_ahead:
            return None
        with self.batch.cond:
            self.stops.poll()
            if self.batch.fatal is not None or nxt.stop_requested or nxt.status not in ("pending", "running"):
                return None
            order = self.order(d, nxt)
        if not self.procs.send(d, order):
            return None
        with self.batch.cond:
            nxt.orders += 1
            self.orders_ahead += 1
        return order

    def run(
        self,
        d: int,
        run: TrialRun,
        *,
        sent: Order | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Run `run`'s next task (or chunk) on device d and book it. Device processes: `sent` is
        its order when it was sent ahead (send_ahead); `then` is called once a one-task order is
        on the pipe (so the next one waits behind it in the pipe), or as a chunk's last task
        ends, before it is booked."""
        if self.procs is None:
            t = run.trial
            task = t.next_task
            order = self.order(d, run)
            self.booking.done(d, run, task, execute(t, self.places[d], evaluate=order.evaluates[0]))
            return
        if sent is not None:
            order = sent
        else:
            with self.batch.cond:
                order = self.order(d, run, chunk=self.cfg.chunk_tasks > 1 and self._lone(d, run))
            run.orders += 1
        try:
            self._run_order(d, run, order, sent=sent is not None, then=then)
        except DeviceDied as exc:
            task = run.trial.next_task
            self.deaths.died(d, run, f"{exc} while running the trial's task {task.kind}{task.shard}")

    def _run_order(
        self, d: int, run: TrialRun, order: Order, *, sent: bool, then: Callable[[], None] | None
    ) -> None:
        """Device processes: each task's Done as it ends, in order, booked as if it had been its
        own order: a chunk's metrics go out step by step, and a process that dies mid-chunk has
        had the steps it finished booked."""
        assert self.procs is not None
        t = run.trial
        stateful = run.entry.job.data.kind == "python"  # the data iterator lives in that process
        going = True
        for done in self.procs.run(
            d,
            order,
            cut=lambda: self._should_cut(d, run),
            poll_s=self.cfg.poll_s,
            sent=sent,
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
            if not self.booking.done(d, run, task, done):
                going = False
                self.procs.cut(d)
