"""A selection batch's fused groups (the request's `fuse`): each group of fusable trials
(trainer/selection/fused.py) trains as one stacked model on one device, step by step, and every
member reports to its own sink what it reports run by the executor (trainer/selection/executor.py):
the same metric names on the same steps (trainer/after_step.py), the same "trial" and "checkpoint"
events, checkpoints in the executor's format (so a fused trial resumes unfused, and the other way
round) and a result of the same shape, so the leaderboard and the API see no difference.

A member that the batch's stop or its own stop ends, that reaches its own `train.steps`, or whose
loss is not finite leaves the stack (`FusedTrials.drop`); the others go on exactly as before.
Groups are spread over the devices, one thread per device, each running its groups in turn.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer.after_step import AfterStep, report_eval, report_step
from trainer.checkpoint import save_checkpoint
from trainer.protocol import StopSignal
from trainer.selection.executor import ExecutorConfig, TrialEntry
from trainer.selection.fused import FusedTrials


@dataclass(kw_only=True, slots=True)
class _Member:
    entry: TrialEntry
    pos: int
    """The member's index in the stack's jobs (FusedTrials.ids)."""
    status: str = "pending"
    steps: int = 0
    loss: float = float("nan")
    val_loss: float = float("nan")
    last_metric: float | None = None
    best_metric: float | None = None
    error: str | None = None
    compute_s: float = 0.0

    @property
    def after(self) -> AfterStep:
        return AfterStep.of(self.entry.job)


class FusedGroups:
    """Run fused groups of trials over `devices`; `run` returns each trial's result by index."""

    def __init__(
        self,
        groups: list[list[TrialEntry]],
        *,
        devices: list[torch.device],
        cfg: ExecutorConfig,
        stop: StopSignal,
        stop_trials: Callable[[], set[int]],
    ) -> None:
        if not devices:
            raise ValueError("a selection batch needs at least one device")
        self.groups = groups
        self.devices = devices
        self.cfg = cfg
        self.stop = stop
        self.stop_trials = stop_trials
        self.results: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def run(self) -> dict[int, dict[str, Any]]:
        queues: list[list[list[TrialEntry]]] = [[] for _ in self.devices]
        for g, group in enumerate(self.groups):
            queues[g % len(self.devices)].append(group)
        errors: list[BaseException] = []

        def work(d: int) -> None:
            try:
                for group in queues[d]:
                    self._run_group(group, self.devices[d])
            except BaseException as exc:  # a bug here, not a trial's failure: re-raised below
                errors.append(exc)

        threads = [
            threading.Thread(target=work, args=(d,), name=f"fused-dev{d}", daemon=True)
            for d in range(len(self.devices))
            if queues[d]
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise RuntimeError(f"fused selection groups failed: {errors[0]!r}") from errors[0]
        return dict(sorted(self.results.items()))

    # -- one group -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _on(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            with torch.cuda.device(device):
                yield
        else:
            yield

    def _run_group(self, group: list[TrialEntry], device: torch.device) -> None:
        names = ", ".join(str(e.index) for e in group)
        for e in group:
            e.sink.log(f"trial {e.index} fused with trials {names} on {device}")
        # a trial asked to stop before it starts ends as the executor ends it: stopped at step 0
        waiting = [_Member(entry=e, pos=-1) for e in group]
        for m in self._poll(waiting):
            self._end(None, m, "stopped")
        members = [m for m in waiting if m.status == "pending"]
        if not members:
            return
        for k, m in enumerate(members):
            m.pos = k
        with self._on(device):
            try:
                fused = FusedTrials([m.entry.job for m in members], device=device)
            except Exception as exc:  # noqa: BLE001 - the group's trials fail, the batch goes on
                for m in members:
                    self._fail(m, f"{type(exc).__name__}: {exc}", traceback.format_exc())
                return
            for m in members:
                m.status = "running"
                m.entry.sink.event("trial", {"status": "running", "steps_done": 0})
            try:
                self._steps(fused, members, device)
            except Exception as exc:  # noqa: BLE001 - the stack's trials fail, the batch goes on
                trace = traceback.format_exc()
                for m in members:
                    if m.status == "running":
                        self._fail(m, f"{type(exc).__name__}: {exc}", trace)

    def _steps(self, fused: FusedTrials, members: list[_Member], device: torch.device) -> None:
        by_pos = {m.pos: m for m in members}

        def running() -> list[_Member]:
            return [by_pos[p] for p in fused.ids if by_pos[p].status == "running"]

        def leave(m: _Member) -> bool:
            """Take an ended member out of the stack; False once it was the last one."""
            if fused.size == 1:
                return False
            fused.drop(m.pos)
            return True

        while True:
            for m in self._poll(running()):
                self._end(fused, m, "stopped")
                if not leave(m):
                    return
            live = running()
            if not live:
                return
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
                m.steps += 1
                m.loss = loss
                m.compute_s += share
                if not math.isfinite(loss):
                    # trainer/loop.py check_finite's words
                    m.error = (
                        f"TrainingError: loss is {loss} at step {m.steps}; lower train.lr or enable grad_clip"
                    )
                    ended.append((m, "failed"))
                    continue
                report_step(
                    m.entry.sink,
                    step=m.steps,
                    loss=loss,
                    seconds=share,
                    tokens=job.train.batch_size * job.model.seq_len,
                    peak_mem_mb=peak / 2**20,
                )
            evaluating = [m for m in live if m.error is None and m.after.evaluates(m.steps)]
            if evaluating:
                t0 = time.perf_counter()
                values = fused.eval_losses([m.pos for m in evaluating])
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
                    path = save_checkpoint(ckpt, step=m.steps, state=fused.trial_state(m.pos))
                    m.entry.sink.event("checkpoint", {"step": m.steps, "path": str(path)})
                if m.steps >= m.entry.job.train.steps:
                    ended.append((m, "succeeded"))
            for m, status in ended:
                if status == "failed":
                    self._fail(m, m.error or "")
                else:
                    self._end(fused, m, status)
                if not leave(m):
                    return

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
            path = save_checkpoint(ckpt, step=m.steps, state=fused.trial_state(m.pos))
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
        with self._lock:
            self.results[m.entry.index] = result
        m.entry.sink.result(result)
        data: dict[str, Any] = {"status": m.status, "steps_done": m.steps}
        if m.error is not None:
            data["error"] = m.error
        m.entry.sink.event("trial", data)

    def _result(self, m: _Member) -> dict[str, Any]:
        """Executor._result's fields: no copies, rungs or dispatch in a stack."""
        return {
            "trial": m.entry.index,
            "status": m.status,
            "steps": m.steps,
            "final_loss": m.loss,
            "val_loss": m.val_loss,
            "metric": self.cfg.metric,
            "last_metric": m.last_metric,
            "best_metric": m.best_metric,
            "stopped_early": False,
            "stop_reason": None,
            "error": m.error,
            "compute_s": m.compute_s,
            "copy_s": 0.0,
            "busy_s": m.compute_s,
            "overhead_s": 0.0,
            "prefetch_s": 0.0,
        }
