"""A selection batch's fused groups: each planned stack of fusable trials
(trainer/selection/fused.py) trains as one stacked model on one device, step by step, and every
member reports to its own sink what it reports run by the executor (trainer/selection/executor.py):
the same metric names on the same steps (trainer/after_step.py), the same "trial" and "checkpoint"
events, checkpoints in the executor's format (so a fused trial resumes unfused, and the other way
round) and a result of the same shape, so the leaderboard and the API see no difference. The result
adds `fused_with`: the other trials the member shared a stack with (None: it trained alone).

A member that the batch's stop or its own stop ends, that reaches its own `train.steps`, or whose
loss is not finite leaves the stack (`FusedTrials.drop`); the others go on exactly as before.

Placement: each stack goes to the device the plan gave it (trainer/selection/fusion_plan.py), one
thread per device running its stacks in turn; a device whose own stacks are done takes a stack
another device has not started. Early stopping (ASHA, SHA, Hyperband: trainer/selection/halving.py,
the executor's rungs and rules): a member that reaches a rung reports its metric there; promoted,
it goes on in its stack; stopped, it leaves; told to wait, it is taken out of the stack with its
state (`FusedTrials.take`) and waits apart, holding no device. Members promoted later are joined
into one stack (`FusedTrials.join`) that the next free device trains. The decisions are the
executor's, a function of the metrics and the batch's seed only.

What a member's step metrics mean in a stack: `step_time_ms` is its share of the fused step (the
step's wall time over the members in it), `tokens_per_s` its own tokens over that share, and
`peak_mem_mb` the device's peak (CUDA) or the stack's buffers (CPU).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.after_step import AfterStep, report_eval, report_step
from trainer.checkpoint import save_checkpoint
from trainer.protocol import StopSignal
from trainer.selection.executor import ExecutorConfig, TrialEntry
from trainer.selection.fused import FusedTrials, difference
from trainer.selection.halving import Decisions, Halving, StopReason
from trainer.selection.trial_ends import how_it_ended

WAIT_S = 0.2
"""How often an idle device looks again for work (a promotion, a stop) while others train."""


@dataclass(kw_only=True, slots=True)
class _Member:
    entry: TrialEntry
    status: str = "pending"
    steps: int = 0
    loss: float = float("nan")
    val_loss: float = float("nan")
    last_metric: float | None = None
    best_metric: float | None = None
    error: str | None = None
    compute_s: float = 0.0
    stop_reason: StopReason | None = None
    fused_with: set[int] = field(default_factory=set)
    """The other trials this one shared a stack step with."""

    @property
    def id(self) -> int:
        return self.entry.index

    @property
    def after(self) -> AfterStep:
        return AfterStep.of(self.entry.job)


@dataclass(kw_only=True, slots=True)
class _Work:
    """A stack to train: planned members to build it from, or a built stack (promoted members)."""

    members: list[_Member]
    built: FusedTrials | None = None


class FusedGroups:
    """Run fused groups of trials over `devices`; `run` returns each trial's result by index.

    `placement`: the device index of each group (the plan's); None: round robin."""

    def __init__(
        self,
        groups: list[list[TrialEntry]],
        *,
        devices: list[torch.device],
        cfg: ExecutorConfig,
        stop: StopSignal,
        stop_trials: Callable[[], set[int]],
        placement: list[int] | None = None,
    ) -> None:
        if not devices:
            raise ValueError("a selection batch needs at least one device")
        if placement is not None and len(placement) != len(groups):
            raise ValueError(f"placement names {len(placement)} devices for {len(groups)} groups")
        self.groups = groups
        self.devices = devices
        self.placement = placement or [g % len(devices) for g in range(len(groups))]
        self.cfg = cfg
        self.stop = stop
        self.stop_trials = stop_trials
        self.results: dict[int, dict[str, Any]] = {}
        self.members = {e.index: _Member(entry=e) for g in groups for e in g}
        self.rungs = (
            Halving(
                cfg.early_stopping, max_steps={i: m.entry.job.train.steps for i, m in self.members.items()}
            )
            if cfg.early_stopping is not None
            else None
        )
        # everything below is shared by the device threads: read and written under the condition
        self._cond = threading.Condition(threading.RLock())
        self.queues: list[deque[_Work]] = [deque() for _ in devices]
        self.parked: dict[int, FusedTrials] = {}
        """Members waiting at a rung, each a stack of its own."""
        self.ready: list[FusedTrials] = []
        """Members promoted while parked, waiting for a device."""
        self.training = 0
        """Stacks a device is training now."""
        self._reporting: FusedTrials | None = None
        """The stack whose members are reporting at a rung (in `_rungs`)."""

    def run(self) -> dict[int, dict[str, Any]]:
        for group, d in zip(self.groups, self.placement, strict=True):
            self.queues[d].append(_Work(members=[self.members[e.index] for e in group]))
        errors: list[BaseException] = []

        def work(d: int) -> None:
            try:
                while (item := self._next(d)) is not None:
                    try:
                        self._run(item, d)
                    finally:
                        with self._cond:
                            self.training -= 1
                            self._cond.notify_all()
            except BaseException as exc:  # a bug here, not a trial's failure: re-raised below
                errors.append(exc)
                with self._cond:
                    self._cond.notify_all()

        threads = [
            threading.Thread(target=work, args=(d,), name=f"fused-dev{d}", daemon=True)
            for d in range(len(self.devices))
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise RuntimeError(f"fused selection groups failed: {errors[0]!r}") from errors[0]
        return dict(sorted(self.results.items()))

    # -- which stack a device trains next --------------------------------------------------------

    def _next(self, d: int) -> _Work | None:
        """Device d's next stack: its own queue's, then promoted members, then another device's
        last queued stack; None once every member has ended."""
        with self._cond:
            while True:
                self._stop_waiting()
                item: _Work | None = None
                if self.queues[d]:
                    item = self.queues[d].popleft()
                elif self.ready:
                    item = self._promoted()
                else:
                    other = max(self.queues, key=len)
                    if other:
                        item = other.pop()
                if item is not None:
                    self.training += 1
                    return item
                if all(m.status in _FINAL for m in self.members.values()):
                    return None
                if self.training == 0:
                    # nothing queued, promoted or training: a member waiting at a rung waits for
                    # no one (the rungs decide once no trial can reach them), so this is a bug
                    raise RuntimeError(
                        "fused groups: members left with nothing to train them: "
                        f"{sorted(i for i, m in self.members.items() if m.status not in _FINAL)}"
                    )
                self._cond.wait(WAIT_S)

    def _promoted(self) -> _Work:
        """Under the lock: the promoted members that fuse with the first one, as one stack."""
        first = self.ready.pop(0)
        same = [f for f in self.ready if difference(first.jobs[0], f.jobs[0]) is None]
        self.ready = [f for f in self.ready if f not in same]
        for f in same:
            first.join(f)
        return _Work(members=[self.members[i] for i in first.ids], built=first)

    def _stop_waiting(self) -> None:
        """Under the lock: members waiting apart (parked or promoted) that the batch's stop or
        their own ends are stopped where they wait."""
        waiting = [(i, f) for i, f in self.parked.items()] + [(i, f) for f in self.ready for i in f.ids]
        if not waiting:
            return
        for m in self._poll([self.members[i] for i, _ in waiting]):
            f = dict(waiting)[m.id]
            self._end(f, m, "stopped")
            self.parked.pop(m.id, None)
            if f in self.ready:
                if f.size == 1:
                    self.ready.remove(f)
                else:
                    f.drop(m.id)

    # -- one stack -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _on(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            with torch.cuda.device(device):
                yield
        else:
            yield

    def _run(self, item: _Work, d: int) -> None:
        device = self.devices[d]
        with self._on(device):
            fused = item.built
            if fused is None:
                # a trial asked to stop before it starts ends as the executor ends it: stopped at step 0
                with self._cond:
                    for m in self._poll(item.members):
                        self._end(None, m, "stopped")
                members = [m for m in item.members if m.status == "pending"]
                if not members:
                    return
                try:
                    fused = FusedTrials(
                        [m.entry.job for m in members], device=device, ids=[m.id for m in members]
                    )
                except Exception as exc:  # noqa: BLE001 - the group's trials fail, the batch goes on
                    with self._cond:
                        for m in members:
                            self._fail(m, f"{type(exc).__name__}: {exc}", traceback.format_exc())
                    return
                for m in members:
                    m.status = "running"
                    m.entry.sink.event("trial", {"status": "running", "steps_done": 0})
            else:
                fused.to(device)
            names = ", ".join(str(i) for i in fused.ids)
            for i in fused.ids:
                e = self.members[i].entry
                if fused.size > 1:
                    e.sink.log(f"trial {e.index} fused with trials {names} on {device}")
                else:
                    e.sink.log(f"trial {e.index} trains alone on {device} (the fusion plan's)")
            try:
                self._steps(fused, device)
            except Exception as exc:  # noqa: BLE001 - the stack's trials fail, the batch goes on
                trace = traceback.format_exc()
                with self._cond:
                    for i in list(fused.ids):
                        m = self.members[i]
                        if m.status == "running" and i not in self.parked:
                            self._fail(m, f"{type(exc).__name__}: {exc}", trace)

    def _steps(self, fused: FusedTrials, device: torch.device) -> None:
        def leave(m: _Member) -> bool:
            """Take an ended member out of the stack; False once it was the last one."""
            if fused.size == 1:
                return False
            fused.drop(m.id)
            return True

        while True:
            with self._cond:
                for m in self._poll([self.members[i] for i in fused.ids]):
                    self._end(fused, m, "stopped")
                    if not leave(m):
                        return
            live = [self.members[i] for i in fused.ids]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            losses = fused.train_step(check=False)
            share = (time.perf_counter() - t0) / len(live)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
            else:
                peak = sum(
                    t.numel() * t.element_size() for t in (fused.flat, fused.grad, *fused.state.values())
                )
            ended: list[tuple[_Member, str]] = []
            for m, loss in zip(live, losses, strict=True):
                job = m.entry.job
                m.compute_s += share
                m.fused_with.update(i for i in fused.ids if i != m.id)
                if not math.isfinite(loss):
                    # trainer/loop.py check_finite's words; the step did not count, as alone
                    m.error = (
                        f"TrainingError: loss is {loss} at step {m.steps + 1}; lower train.lr or enable "
                        "grad_clip"
                    )
                    ended.append((m, "failed"))
                    continue
                m.steps += 1
                m.loss = loss
                report_step(
                    m.entry.sink,
                    step=m.steps,
                    loss=loss,
                    seconds=share,
                    tokens=job.train.batch_size * job.model.seq_len,
                    peak_mem_mb=peak / 2**20,
                )
            rung = {m.id for m in live if self.rungs is not None and self.rungs.is_rung(m.id, m.steps)}
            evaluating = [
                m
                for m in live
                if m.error is None
                and (m.after.evaluates(m.steps) or (m.id in rung and self.cfg.metric != "loss"))
            ]
            if evaluating:
                t0 = time.perf_counter()
                values = fused.eval_losses([m.id for m in evaluating])
                each = (time.perf_counter() - t0) / len(evaluating)
                for m, v in zip(evaluating, values, strict=True):
                    m.compute_s += each
                    m.val_loss = v
                    report_eval(m.entry.sink, step=m.steps, val_loss=v)
                    if self.cfg.metric == "val_loss":
                        self._record(m, v)
            for m in live:
                if m.error is not None:
                    continue
                if self.cfg.metric == "loss":
                    self._record(m, m.loss)
                ckpt = m.entry.checkpoint_dir
                if ckpt is not None and m.after.checkpoints(m.steps):
                    path = save_checkpoint(ckpt, step=m.steps, state=fused.trial_state(m.id))
                    m.entry.sink.event("checkpoint", {"step": m.steps, "path": str(path)})
                if m.steps >= m.entry.job.train.steps:
                    ended.append((m, "succeeded"))
            with self._cond:
                for m, status in ended:
                    if status == "failed":
                        self._fail(m, m.error or "")
                    else:
                        self._end(fused, m, status)
                    if not leave(m):
                        return
                if not self._rungs(fused, [m for m in live if m.id in rung and m.status == "running"]):
                    return

    def _rungs(self, fused: FusedTrials, at_rung: list[_Member]) -> bool:
        """Under the lock: the members at a rung report; each goes on, stops or waits apart.
        False once no member is left in the stack."""
        if self.rungs is None or not at_rung:
            return True
        # a decision can end a member of this stack from inside another's end (a stop that
        # completes the rung): _apply finds it here
        self._reporting = fused
        try:
            for m in at_rung:
                m.status = "paused"
                value = m.last_metric if m.last_metric is not None else m.loss
                self._apply(self.rungs.report(m.id, step=m.steps, value=value), fused)
        finally:
            self._reporting = None
        for m in at_rung:
            if m.status == "running":  # promoted: it goes on in the stack
                continue
            if fused.size == 1:
                if m.status == "paused":
                    self.parked[m.id] = fused
                return False
            if m.status == "paused":  # told to wait: apart from the stack, so the others go on
                self.parked[m.id] = fused.take(m.id)
            else:  # stopped early: it ended above
                fused.drop(m.id)
        return True

    def _apply(self, decisions: Decisions, here: FusedTrials | None = None) -> None:
        """Under the lock: the rungs' decisions. A promoted member goes on (in `here`, the stack
        it reported from, or, promoted while it waited apart, to `ready`); a stopped one ends where
        it is (`here` or apart; the caller takes it out of `here`)."""
        for i in decisions.promoted:
            m = self.members[i]
            if m.status == "paused":
                m.status = "running"
            if i in self.parked:
                self.ready.append(self.parked.pop(i))
        here = here or self._reporting
        for i in decisions.stopped:
            m = self.members[i]
            if m.status in _FINAL:
                continue
            m.stop_reason = decisions.reasons.get(i)
            if i in self.parked:
                self._end(self.parked.pop(i), m, "stopped_early")
            else:
                assert here is not None and i in here.ids, f"trial {i} stopped by a rung it is not at"
                self._end(here, m, "stopped_early")
        self._cond.notify_all()

    # -- stops and ends --------------------------------------------------------------------------

    def _poll(self, live: list[_Member]) -> list[_Member]:
        """The members to stop now (the batch's stop, or their own)."""
        stopping = self.stop.requested()
        wanted = self.stop_trials()
        return [m for m in live if stopping or m.entry.index in wanted]

    def _record(self, m: _Member, value: float) -> None:
        m.last_metric = value
        best = m.best_metric
        if best is None or (value < best if self.cfg.mode == "min" else value > best):
            m.best_metric = value

    def _end(self, fused: FusedTrials | None, m: _Member, status: str) -> None:
        """The executor's `_finish`: the end-of-trial checkpoint (unless `none`), the result, the
        final event. Checkpoints `none` removes the trial's directory; `best` is the batch's
        (trainer/selection/job.py keeps the best trial's once every trial has ended)."""
        ckpt = m.entry.checkpoint_dir
        if fused is not None and ckpt is not None and m.steps > 0 and self.cfg.checkpoints != "none":
            # a checkpoint that cannot be written raises with the member still running: it fails
            path = save_checkpoint(ckpt, step=m.steps, state=fused.trial_state(m.id))
            m.entry.sink.event("checkpoint", {"step": m.steps, "path": str(path)})
        m.status = status
        self._report_end(m)
        if self.cfg.checkpoints == "none" and ckpt is not None:
            shutil.rmtree(ckpt, ignore_errors=True)

    def _fail(self, m: _Member, error: str, trace: str = "") -> None:
        m.error = error
        m.entry.sink.log(f"trial {m.entry.index} failed: {error}\n{trace}")
        m.status = "failed"
        self._report_end(m)
        if self.cfg.checkpoints == "none" and m.entry.checkpoint_dir is not None:
            shutil.rmtree(m.entry.checkpoint_dir, ignore_errors=True)

    def _report_end(self, m: _Member) -> None:
        result = self._result(m)
        with self._cond:
            self.results[m.entry.index] = result
        m.entry.sink.result(result)
        data: dict[str, Any] = {"status": m.status, "steps_done": m.steps}
        if m.stop_reason is not None:
            data["stop_reason"] = result["stop_reason"]
        if m.error is not None:
            data["error"] = m.error
        m.entry.sink.event("trial", data)
        with self._cond:
            if self.rungs is not None:
                # an ended member reaches no further rung, which can complete one
                self._apply(self.rungs.finished(m.id, step=m.steps))
            self._cond.notify_all()

    def _result(self, m: _Member) -> dict[str, Any]:
        """Ends.result's fields (trial_ends.py; no copies or dispatch in a stack), and `fused_with`."""
        return {
            "trial": m.entry.index,
            "status": m.status,
            "steps": m.steps,
            "final_loss": m.loss,
            **how_it_ended(m, self.cfg.metric),
            "compute_s": m.compute_s,
            "copy_s": 0.0,
            "busy_s": m.compute_s,
            "overhead_s": 0.0,
            "prefetch_s": 0.0,
            "fused_with": sorted(m.fused_with) or None,
        }


_FINAL = ("succeeded", "stopped_early", "stopped", "failed")
