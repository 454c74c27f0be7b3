"""Double buffering across trials, for one device: as the device is dispatched it also reserves the
trial it will run next and starts copying that trial's next shard in while the current one
computes (on CUDA on the device's copy stream; on a CPU thread the same call binds the host copy;
a device process binds it when the task comes, host and device being one memory there)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.selection.devices import Order
from trainer.selection.dispatch import Dispatcher
from trainer.selection.reservations import Reservations
from trainer.selection.shards import Place
from trainer.selection.trial_ends import Ends
from trainer.selection.trial_run import Batch, TrialRun


@dataclass(kw_only=True, slots=True, eq=False)
class Prefetch:
    """One device's next trial: reserved, copied in, then taken (or given up)."""

    batch: Batch
    d: int
    dispatcher: Dispatcher
    ends: Ends
    booked: Reservations
    """The device's reservations (the policy's plan of its bytes)."""
    place: Place
    threads: bool
    """The device is a thread of this process (no device processes)."""
    reserved: TrialRun | None = None
    """The trial this device runs next, held by it since its last dispatch."""
    ahead: Order | None = None
    """Device processes: the order already sent for `reserved` (DeviceTasks.send_ahead)."""

    def choose(self, run: TrialRun) -> TrialRun | None:
        """Under the lock, as `run` is dispatched: the trial to run after it, reserved (held by this
        device, its next shard's bytes booked), or None."""
        b = self.batch
        # reserve the next trial only when no device is waiting for work, so a reservation never
        # keeps a free device idle; and not for a growing batch on device processes: there a
        # reservation copies nothing ahead (one memory), and with the few trials a sampler keeps
        # in flight it pins two of them to this device while another has one to itself, so the
        # trial with the least work left runs on and the batch's last trials end apart (longest
        # first, they end together)
        if not (b.cfg.prefetch and b.waiting == 0 and not (b.processes and b.grows)):
            return None
        nxt = self.dispatcher.pick(self.d, exclude=run)
        if nxt is not None:
            nt = nxt.trial
            self.booked.reserve((nxt.index, "prefetch"), nt.copy_bytes[nt.next_task.shard])
        return nxt

    def copy(self, run: TrialRun) -> None:
        """Start copying `run`'s next shard to the device (outside the lock)."""
        run.prefetches += 1
        if not self.threads:
            return
        t = run.trial
        task = t.next_task
        dt = t.copy_in(task.shard, self.place, state=task.steps, grads=task.kind == "S")
        run.copy_s += dt
        run.prefetch_s += dt

    def take(self) -> TrialRun | None:
        """Under the lock: the reserved trial, now to run; None when it was asked to stop between
        mini-batches, and stopped here instead."""
        run, self.reserved = self.reserved, None
        assert run is not None
        self.booked.release((run.index, "prefetch"))
        # an order sent ahead is in the device's pipe: it runs as sent
        if self.ahead is None and run.stop_requested and run.trial.pos == 0:
            if self.threads:
                run.trial.shards[run.trial.next_task.shard].spill()
            run.holder = None
            self.ends.finish(run, "stopped")
            return None
        return run

    def drop(self, nxt: TrialRun | None) -> None:
        """Under the lock, the device's process having died: its reservation goes back; the trial
        itself is whole (an order sent ahead never started: the process died before it ended the
        one before)."""
        if nxt is not None:
            self.booked.release((nxt.index, "prefetch"))
            nxt.holder = None
