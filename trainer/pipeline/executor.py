"""Runs one pipeline training step on this rank with point-to-point messages over gloo.

Static mode executes the rank's action list in order. Message-driven mode (schedule `async`,
after AxoNN) takes whichever input arrived first, backward work before forward, and lets stage 0
inject a new micro-batch whenever fewer than `cap` are in flight.

Every receive of the step is posted up front, and a waiter thread per receive announces its
arrival: gloo's `Work.is_completed()` does not report a finished irecv until someone waits on it,
so polling cannot tell which message came first, but a thread blocked in `wait()` can.

Micro-batch losses are lm_loss / N, so the gradients accumulated over the N micro-batches equal
the full-batch gradient. Chimera's two copies of a stage exchange gradients (AR actions) as soon as
both are final; the sum lands in both copies before the optimizer step, so they stay identical.

torch.distributed.pipelining is not used for execution: its PipelineStage binds one stage to one
rank in one direction and its schedules run fixed orders, while Chimera needs two stage copies per
rank on two opposite rank orders and the async mode needs arrival-order execution. The tests
check this executor against its ScheduleGPipe / Schedule1F1B on the same model and data.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.models import lm_loss
from trainer.pipeline.schedules import Action, Schedule, async_cap

_ACT, _GRAD, _AR = 0, 1, 2


def _tag(kind: int, *, mb: int, stage: int, replica: int) -> int:
    """One tag per message, so receives match by content and not by arrival order."""
    return ((kind * 2 + replica) * 4096 + stage) * 65536 + mb + 1


@dataclass(kw_only=True, slots=True)
class StepRecord:
    loss: float
    """Sum over this rank's last-stage micro-batches of loss / N (all-reduce it for the total)."""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    peak_stash: int = 0


@dataclass(slots=True)
class _Stashed:
    """What a forward leaves for its backward: the stage input (its .grad is the message back),
    the output (or the scaled loss on the last stage) and, between a split B and its W, the
    output gradient W needs again."""

    inp: torch.Tensor
    out: torch.Tensor
    grad_out: torch.Tensor | None = None


class _Mailbox:
    """Pre-posted receives; a thread per receive marks it arrived when its wait() returns."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._cond = threading.Condition()
        self.buffers: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self.arrived: set[tuple[int, int, int, int]] = set()
        self._error: BaseException | None = None

    def post(self, key: tuple[int, int, int, int], buf: torch.Tensor, src: int, group: Any) -> None:
        kind, mb, stage, replica = key
        self.buffers[key] = buf
        work = dist.irecv(buf, src=src, group=group, tag=_tag(kind, mb=mb, stage=stage, replica=replica))
        self._pool.submit(self._watch, key, work)

    def _watch(self, key: tuple[int, int, int, int], work: Any) -> None:
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            with self._cond:
                self._error = e
                self._cond.notify_all()
            return
        with self._cond:
            self.arrived.add(key)
            self._cond.notify_all()

    def wait_for(self, key: tuple[int, int, int, int]) -> torch.Tensor:
        with self._cond:
            self._cond.wait_for(lambda: key in self.arrived or self._error is not None)
            if self._error is not None:
                raise self._error
            self.arrived.discard(key)
        return self.buffers.pop(key)

    def wait_any(self, want: Callable[[set[tuple[int, int, int, int]]], bool]) -> None:
        """Block until `want(arrived)` holds (the caller decides what it can act on)."""
        with self._cond:
            self._cond.wait_for(lambda: want(self.arrived) or self._error is not None)
            if self._error is not None:
                raise self._error

    def snapshot(self) -> set[tuple[int, int, int, int]]:
        with self._cond:
            return set(self.arrived)


class PipelineExecutor:
    def __init__(
        self,
        *,
        sched: Schedule,
        rank: int,
        modules: dict[tuple[int, int], nn.Module],
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        group: Any = None,
        ranks: list[int] | None = None,
        cap: int | None = None,
        delay: Callable[[Action], float] | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    ) -> None:
        """`ranks` maps pipeline rank to global rank (default identity); `delay(action)` returns
        seconds to sleep before the action's compute (jitter injection for tests and benches);
        `loss_fn(outputs, targets)` is the model recipe's mean loss of one micro-batch."""
        self.sched = sched
        self.rank = rank
        self.modules = modules
        self.act_shape = act_shape
        self.act_dtype = act_dtype
        self.device = device or torch.device("cpu")
        self.group = group
        self.ranks = ranks or list(range(sched.stages))
        self.cap = cap if cap is not None else async_cap(sched.stages)
        self.delay = delay
        self.loss_fn = loss_fn
        n_recv = sum(1 for a in sched.ranks[rank] if self._source(a) is not None) + 4
        self._pool = ThreadPoolExecutor(max_workers=n_recv, thread_name_prefix=f"pp{rank}-recv")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- where messages come from and go to -------------------------------------------------
    def _peer(self, *, stage: int, replica: int) -> int:
        return self.ranks[self.sched.rank_of(stage=stage, replica=replica)]

    def _source(self, a: Action) -> tuple[int, int] | None:
        """(kind, global source rank) of the message action `a` consumes, if any."""
        D = self.sched.stages
        if a.op == "F" and a.stage > 0:
            return _ACT, self._peer(stage=a.stage - 1, replica=a.replica)
        if a.op == "B" and a.stage < D - 1:
            return _GRAD, self._peer(stage=a.stage + 1, replica=a.replica)
        return None

    # ---- one step ---------------------------------------------------------------------------
    def step(self, x_BT: torch.Tensor, y_BT: torch.Tensor, *, t0: float | None = None) -> StepRecord:
        """Run this rank's share of one step; parameter gradients are left in `.grad`."""
        sched, N = self.sched, self.sched.microbatches
        t0 = time.perf_counter() if t0 is None else t0
        xs = x_BT.to(self.device).chunk(N)
        ys = y_BT.to(self.device).chunk(N)
        mail = _Mailbox(self._pool)
        for a in sched.ranks[self.rank]:
            src = self._source(a)
            if src is not None:
                kind, peer = src
                buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                mail.post((kind, a.mb, a.stage, a.replica), buf, peer, self.group)
        run = _StepRun(self, mail=mail, xs=xs, ys=ys, t0=t0)
        if sched.dynamic:
            run.message_driven()
        else:
            for a in sched.ranks[self.rank]:
                run.do(a)
        run.finish()
        return StepRecord(loss=run.loss, timeline=run.timeline, peak_stash=run.peak_stash)


class _StepRun:
    """The mutable state of one step on one rank."""

    def __init__(
        self,
        ex: PipelineExecutor,
        *,
        mail: _Mailbox,
        xs: tuple[torch.Tensor, ...],
        ys: tuple[torch.Tensor, ...],
        t0: float,
    ) -> None:
        self.ex = ex
        self.mail = mail
        self.xs, self.ys = xs, ys
        self.t0 = t0
        self.stash: dict[tuple[int, int, int], _Stashed] = {}
        self.peak_stash = 0
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.exchanges: list[
            tuple[Any, Any, torch.Tensor, torch.Tensor, tuple[int, int], dict[str, Any]]
        ] = []
        self.loss = 0.0
        self.timeline: list[dict[str, Any]] = []

    def _send(self, t: torch.Tensor, *, dst: int, tag: int) -> None:
        t = t.detach().contiguous()
        # keep the tensor alive until the send completes
        self.sends.append((dist.isend(t, dst=dst, group=self.ex.group, tag=tag), t))

    def _record(self, a: Action, start: float) -> dict[str, Any]:
        e = {
            "rank": self.ex.rank,
            "op": a.op,
            "mb": a.mb,
            "stage": a.stage,
            "replica": a.replica,
            "start": start - self.t0,
            "end": time.perf_counter() - self.t0,
        }
        self.timeline.append(e)
        return e

    def do(self, a: Action) -> None:
        if a.op == "AR":
            self._allreduce(a)
            return
        D, N = self.ex.sched.stages, self.ex.sched.microbatches
        key = (a.mb, a.stage, a.replica)
        mod = self.ex.modules[(a.stage, a.replica)]
        src = self.ex._source(a)
        received = self.mail.wait_for((src[0], a.mb, a.stage, a.replica)) if src else None
        start = time.perf_counter()
        if self.ex.delay is not None:
            # injected inside the timed span: it stands for slower compute, not a late message
            time.sleep(self.ex.delay(a))
        if a.op == "F":
            inp = self.xs[a.mb] if a.stage == 0 else received.requires_grad_()
            out = mod(inp)
            if a.stage == D - 1:
                # note: scaled by 1/N so the N micro-batch gradients sum to the full-batch one
                out = self.ex.loss_fn(out, self.ys[a.mb]) / N
                self.loss += out.item()
            else:
                self._send(
                    out, dst=self.ex._peer(stage=a.stage + 1, replica=a.replica), tag=self._tag(_ACT, a)
                )
            self.stash[key] = _Stashed(inp=inp, out=out)
            self.peak_stash = max(self.peak_stash, len(self.stash))
        elif a.op == "B":
            st = self.stash[key]
            if self.ex.sched.split_backward:
                if a.stage > 0:
                    # input gradient only; the graph stays for the deferred weight gradient
                    (g,) = torch.autograd.grad(st.out, st.inp, grad_outputs=received, retain_graph=True)
                    self._send(
                        g, dst=self.ex._peer(stage=a.stage - 1, replica=a.replica), tag=self._tag(_GRAD, a)
                    )
                st.grad_out = received
            else:
                torch.autograd.backward(st.out, grad_tensors=received)
                if a.stage > 0:
                    self._send(
                        st.inp.grad,
                        dst=self.ex._peer(stage=a.stage - 1, replica=a.replica),
                        tag=self._tag(_GRAD, a),
                    )
                del self.stash[key]
        elif a.op == "W":
            st = self.stash.pop(key)
            params = [p for p in mod.parameters() if p.requires_grad]
            grads = torch.autograd.grad(st.out, params, grad_outputs=st.grad_out, allow_unused=True)
            for p, g in zip(params, grads, strict=True):
                if g is None:
                    continue
                p.grad = g if p.grad is None else p.grad + g
        self._record(a, start)

    @staticmethod
    def _tag(kind: int, a: Action) -> int:
        # the receiver files a message under the stage that consumes it
        stage = a.stage + 1 if kind == _ACT else a.stage - 1
        return _tag(kind, mb=a.mb, stage=stage, replica=a.replica)

    def _allreduce(self, a: Action) -> None:
        """Start the gradient exchange of this stage copy with the other replica's copy."""
        start = time.perf_counter()
        mod = self.ex.modules[(a.stage, a.replica)]
        params = list(mod.parameters())
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        other = torch.empty_like(flat)
        peer = self.ex._peer(stage=a.stage, replica=1 - a.replica)
        send = dist.isend(
            flat, dst=peer, group=self.ex.group, tag=_tag(_AR, mb=-1, stage=a.stage, replica=a.replica)
        )
        recv = dist.irecv(
            other, src=peer, group=self.ex.group, tag=_tag(_AR, mb=-1, stage=a.stage, replica=1 - a.replica)
        )
        entry = self._record(a, start)
        self.exchanges.append((send, recv, flat, other, (a.stage, a.replica), entry))

    def message_driven(self) -> None:
        """AxoNN-style: act on whatever has arrived, gradients first."""
        ex, mail = self.ex, self.mail
        D, N = ex.sched.stages, ex.sched.microbatches
        s = ex.rank  # single replica: stage s on rank s
        f_done: set[int] = set()
        b_done: set[int] = set()
        next_inject = 0

        def choose(arrived: set[tuple[int, int, int, int]]) -> Action | None:
            ready_b = [m for m in f_done - b_done if s == D - 1 or (_GRAD, m, s, 0) in arrived]
            if ready_b:
                return Action("B", min(ready_b), s)
            if s == 0:
                if next_inject < N and len(f_done) - len(b_done) < ex.cap:
                    return Action("F", next_inject, 0)
                return None
            ready_f = [k[1] for k in arrived if k[0] == _ACT and k[1] not in f_done]
            return Action("F", min(ready_f), s) if ready_f else None

        while len(b_done) < N:
            a = choose(mail.snapshot())
            if a is None:
                mail.wait_any(lambda arrived: choose(arrived) is not None)
                continue
            self.do(a)
            if a.op == "F":
                f_done.add(a.mb)
                if s == 0:
                    next_inject += 1
            else:
                b_done.add(a.mb)

    def finish(self) -> None:
        for work, _ in self.sends:
            work.wait()
        for send, recv, flat, other, (stage, replica), entry in self.exchanges:
            send.wait()
            recv.wait()
            entry["end"] = time.perf_counter() - self.t0
            total = flat + other
            offset = 0
            for p in self.ex.modules[(stage, replica)].parameters():
                n = p.numel()
                p.grad = total[offset : offset + n].view_as(p).clone()
                offset += n
        self.sends.clear()
        self.exchanges.clear()
