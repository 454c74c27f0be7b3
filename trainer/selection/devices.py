"""A selection batch's CPU "devices" as processes, and the one function that runs a task on a device.

Why processes: CPU devices that are threads of one process share the interpreter lock, so the
Python half of one device's task (autograd's bookkeeping, the optimizer's loop over parameters)
waits for the other device's; measured on 2 cores, the threaded executor spent 25% more CPU time
than the same trials in two plain processes. So on CPU each device is a process forked from the
executor, with its own torch threads (the cores shared out, one each on a 2-core machine).

Every decision stays in the parent (trainer/selection/executor.py): its per-device dispatch thread
chooses the task as before, sends it down the device's pipe (an `Order`), waits, and applies the
reply (a `Done` per task: timings, the trial's step and loss, a val_loss) to the metric sinks, the
rungs and the checkpoints. `execute` is the task itself, the same for a device thread and a device
process. A lone trial's order carries a chunk of tasks (up to the next point where the parent acts
on the trial); the process runs them back to back, sends each task's `Done` as it ends (so the
parent books the steps live, and those of a process that dies mid-chunk), and stops after the
running task once the parent sets the device's cut flag (a stop was asked, or another trial waits
for a device).

Memory: before the fork, every trial's tensors that outlive a mini-batch (weights, optimizer state,
step counts, buffers) move into one block of shared memory per trial (`ShardedTrial.share`). A
forked process inherits the trials and trains them in place, and a trial runs on either process with
nothing copied (host and device are the same memory: a shard is bound by alias, never copied). A
trial added after the start is built and shared in the parent and handed over with its first task:
its block travels as a file descriptor, the process builds the same model and adopts the block.
An ended trial is forgotten (`Forget`): the process drops it, and with it the mapping of its block.
What lives only within a mini-batch (boundary activations, parked gradients) stays in the process
that ran the mini-batch's first task, so the executor moves a trial between processes only between
mini-batches; a trial whose data is the user's own iterable keeps its process for good (the
iterator's position lives there).

Faults: the parent waits on the reply and on the process's exit at once. A process that dies (kill
-9, the OOM killer) raises `DeviceDied` naming the device, the process and the signal; the executor
fails the trial it was running and every trial whose mini-batch it held, and the batch goes on over
the other devices.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the pickling of shared tensors as fds

from jobrules.spec import JobSpec
from trainer.priority import cores_given, omp_capped
from trainer.report import Reports, collecting, evaluation
from trainer.selection.shards import HOST, Place, ShardedTrial
from trainer.spill.ledger import DeviceLedger

PR_SET_PDEATHSIG = 1


class DeviceDied(RuntimeError):
    """A device process ended while it held a task."""


@dataclass(kw_only=True, slots=True)
class Adoption:
    """A trial the device process has not seen: the job to build it from and its shared block."""

    job: JobSpec
    block: torch.Tensor
    budget_bytes: int | None
    prefetch: bool


@dataclass(kw_only=True, slots=True)
class Order:
    """Run trial `trial`'s next tasks, one per entry of `evaluates` (a chunk: several when nothing
    else could use the device meanwhile). `step`, `pos` and `loss` are the parent's record of the
    trial, which a process that last saw it before its latest mini-batches takes over."""

    trial: int
    step: int
    pos: int
    loss: float
    evaluates: list[bool]
    """Per task of the chunk: it ends a mini-batch after which the trial evaluates (the parent's
    rule). The process runs them in order and stops early at a failure or when the parent raises
    the device's cut flag (checked between tasks)."""
    adopt: Adoption | None = None


@dataclass(kw_only=True, slots=True)
class Forget:
    """These trials have ended and nothing will run them again: drop them and their shared blocks."""

    trials: list[int]


@dataclass(kw_only=True, slots=True)
class Done:
    """What a task did, for the parent's books."""

    start: float
    end: float
    ran: bool = False
    """The task itself completed (its evaluation may still have failed)."""
    compute_s: float = 0.0
    copy_s: float = 0.0
    eval_s: float = 0.0
    step: int
    pos: int
    loss: float
    val_loss: float | None = None
    peak_bytes: int = 0
    """The device ledger's peak once the task ran (before any evaluation), as a step reports it."""
    held_bytes: int = 0
    error: str | None = None
    trace: str = ""
    reports: Reports | None = None
    """What the trial's own code reported during the task and its evaluation (trainer/report.py)."""


def execute(t: ShardedTrial, place: Place, *, evaluate: bool) -> Done:
    """Run `t`'s next task at `place`, then its evaluation if asked. A failure is returned, not
    raised, with what the failed task left on the device freed, so the device goes on."""
    start = time.perf_counter()
    done = Done(start=start, end=start, step=t.step, pos=t.pos, loss=t.loss)
    reports = Reports()
    try:
        with collecting(reports, thread=True):  # this thread runs this trial's task alone
            timing = t.run_task(place)
            done.end = time.perf_counter()
            done.ran, done.compute_s, done.copy_s = True, timing.compute_s, timing.copy_s
            done.peak_bytes = place.ledger.peak
            if evaluate:
                assert t.pos == 0, "only a mini-batch's last task evaluates"
                with evaluation(reports):
                    done.val_loss = t.evaluate(place)
                done.eval_s = time.perf_counter() - done.end
    except Exception as exc:  # noqa: BLE001 - the trial fails, the device goes on
        done.error, done.trace = f"{type(exc).__name__}: {exc}", traceback.format_exc()
        with contextlib.suppress(Exception):
            for shard in t.shards:
                shard.spill()
        place.ledger.release_prefix(f"t{t.index}.")
    done.step, done.pos, done.loss = t.step, t.pos, t.loss
    done.held_bytes = place.ledger.held
    done.reports = reports if reports else None
    return done


def threads_per_device(devices: int) -> int:
    """The cores this process may use (the run's share where its worker gives one,
    trainer/priority.py), shared out: one torch thread each on a 2-core machine; no more than
    OMP_NUM_THREADS where the worker's environment sets it, as for a job's processes."""
    return omp_capped(max(1, (cores_given() or len(os.sched_getaffinity(0))) // devices))


def _serve(
    *,
    d: int,
    conn: Connection,
    others: list[Connection],
    trials: dict[int, ShardedTrial],
    budget_bytes: int | None,
    threads: int,
    cut: Any,
    after_fork: Callable[[], None] | None,
) -> None:
    """A device process: run the orders that come down the pipe until told to stop or orphaned."""
    for c in others:  # the other devices' ends: a sibling must not keep a dead pipe open
        c.close()
    if after_fork is not None:  # drop the parent's own references to the trials (see Forget)
        after_fork()
    # Ctrl-C reaches the whole process group; the parent decides how the batch stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    torch.set_num_threads(threads)
    place = Place(
        device=HOST, ledger=DeviceLedger(budget_bytes=budget_bytes, strict=budget_bytes is not None)
    )
    while True:
        try:
            msg: Order | Forget | None = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if msg is None:
            return
        if isinstance(msg, Forget):
            for i in msg.trials:
                trials.pop(i, None)
        else:
            for done in _chunk(d, msg, trials, place, cut):
                conn.send(done)  # as each task ends: the parent books it while the next one runs
            conn.send(None)  # the order is done
        msg = None  # an adoption's block goes with its trial, not with the last message


def _chunk(d: int, order: Order, trials: dict[int, ShardedTrial], place: Place, cut: Any) -> Iterator[Done]:
    """Run an order's tasks in order, yielding each one's Done as it ends; stop after a failure,
    or between tasks once `cut` is set."""
    try:
        if order.adopt is not None:
            a = order.adopt
            t = ShardedTrial.build(a.job, index=order.trial, budget_bytes=a.budget_bytes, prefetch=a.prefetch)
            t.adopt(a.block)
            trials[order.trial] = t
        t = trials[order.trial]
        assert order.pos == 0 or t.pos == order.pos, (
            f"trial {order.trial} came to device {d} in the middle of a mini-batch another ran"
        )
        t.step, t.pos, t.loss = order.step, order.pos, order.loss
    except Exception as exc:  # noqa: BLE001 - reported as the task's failure
        now = time.perf_counter()
        yield Done(
            start=now,
            end=now,
            step=order.step,
            pos=order.pos,
            loss=order.loss,
            error=f"{type(exc).__name__}: {exc}",
            trace=traceback.format_exc(),
        )
        return
    for n, evaluate in enumerate(order.evaluates):
        if n and cut.value:
            return
        done = execute(t, place, evaluate=evaluate)
        yield done
        if done.error is not None:
            return


class DeviceProcesses:
    """One forked process per CPU device, started once the trials are built and shared."""

    def __init__(
        self,
        labels: list[str],
        *,
        trials: dict[int, ShardedTrial],
        budget_bytes: int | None,
        after_fork: Callable[[], None] | None = None,
    ) -> None:
        """`after_fork` runs first in each child: it drops the parent's references to the trials
        (the child inherits the parent's objects), so that `trials` alone holds them there."""
        ctx = mp.get_context("fork")  # CPU only: the children inherit the trials, nothing is pickled
        self.labels = labels
        pipes = [ctx.Pipe() for _ in labels]
        self.cuts = [ctx.RawValue("b", 0) for _ in labels]
        """Per device: set by the parent to end the running chunk at its next task boundary."""
        threads = threads_per_device(len(labels))
        self.procs: list[Any] = []
        for d, (_, child) in enumerate(pipes):
            others = [c for pair in pipes for c in pair if c is not child]
            p = ctx.Process(
                target=_serve,
                kwargs={
                    "d": d,
                    "conn": child,
                    "others": others,
                    "trials": trials,
                    "budget_bytes": budget_bytes,
                    "threads": threads,
                    "cut": self.cuts[d],
                    "after_fork": after_fork,
                },
                name=f"selection-{labels[d]}",
                daemon=True,
            )
            p.start()
            self.procs.append(p)
        for _, child in pipes:
            child.close()
        self.conns = [parent for parent, _ in pipes]
        self.known = [set(trials) for _ in labels]
        """Per device: the trials its process holds (inherited at the fork or adopted since)."""

    def knows(self, d: int, trial: int) -> bool:
        return trial in self.known[d]

    def send(self, d: int, order: Order) -> bool:
        """Queue `order` on device d's pipe without waiting: sent while the process runs another
        order, it starts the moment that one ends, with no round trip to this process between
        them. Its Dones are read by `run(d, order, sent=True)`. False when the pipe is gone (the
        process died: the next `run` says how)."""
        self.cuts[d].value = 0  # only device d's thread writes it, between chunks
        try:
            self.conns[d].send(order)
        except OSError:
            return False
        if order.adopt is not None:
            self.known[d].add(order.trial)
        return True

    def run(
        self,
        d: int,
        order: Order,
        *,
        cut: Callable[[], bool] | None = None,
        poll_s: float = 0.05,
        sent: bool = False,
        on_sent: Callable[[], None] | None = None,
        on_last: Callable[[], None] | None = None,
    ) -> Iterator[Done]:
        """Send the order to device d's process (unless `sent` by `send` already) and yield the
        Done of each task it runs, as each ends (a chunk's metrics reach the parent step by step,
        and the steps a process finished before it died are booked), until the order is done;
        raises DeviceDied if the process ends first. While a chunk of several tasks runs, `cut` is
        asked every `poll_s`: once it says so, the process stops the chunk after the task it is
        running. `on_sent` is called once the order is on the pipe, `on_last` when its last
        task's Done arrives, before it is yielded (the caller may `send` the next order then).
        The caller reads to the end (a Done it will not book still comes off the pipe)."""
        conn, proc = self.conns[d], self.procs[d]
        if not sent and not self.send(d, order):
            raise self._died(d)
        if on_sent is not None:
            on_sent()
        chunk = len(order.evaluates) > 1 and cut is not None
        got = 0
        while True:
            ready = wait([conn, proc.sentinel], timeout=poll_s if chunk else None)
            if not ready:
                if cut is not None and cut():
                    self.cuts[d].value = 1
                    chunk = False
                continue
            if conn not in ready:  # what it sent before it ended is read first
                raise self._died(d)
            try:
                done = conn.recv()
            except (EOFError, OSError):
                raise self._died(d) from None
            if done is None:
                return
            got += 1
            if on_last is not None and got == len(order.evaluates):
                on_last()
            yield done

    def cut(self, d: int) -> None:
        """End device d's running chunk after the task it is running."""
        self.cuts[d].value = 1

    def forget(self, d: int, trials: list[int]) -> None:
        """Device d's process drops these ended trials (no reply). From device d's dispatch thread
        only, between its orders."""
        self.known[d].difference_update(trials)
        with contextlib.suppress(OSError):  # a dead process is reported by the next order
            self.conns[d].send(Forget(trials=trials))

    def _died(self, d: int) -> DeviceDied:
        proc = self.procs[d]
        proc.join(timeout=5)
        code = proc.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            how = f"exited with status {code}"
        return DeviceDied(f"device {self.labels[d]} (process {proc.pid}) died: {how}")

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
