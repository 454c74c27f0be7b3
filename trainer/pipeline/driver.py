"""Runs one pipeline training step on this rank with untagged point-to-point messages.

Written for NCCL's rules and tested on gloo with tag 0 everywhere:

- NCCL ignores tags and matches a pair's sends and receives in issue order; gloo with one tag
  matches first-in first-out. So no message carries a tag: a receive gets whatever the peer sent
  in that position of the pair's order, and the order is planned so that it is the right message.
- `Work.wait()` on NCCL does not block the CPU (it makes the compute stream wait), and a posted
  receive holds up the operations queued behind it. So receives are posted just before they are
  needed, never all at the start of the step, and nothing decides what to run next by blocking.

Static schedules run the rank's lowered program (`schedules.lower`): groups of sends and receives
issued with one `dist.batch_isend_irecv` each, and computations that wait for the receives they
need. `checker.check_nccl` proves every lowered program deadlock-free and correctly matched under
NCCL's semantics.

Message-driven mode (schedule `async`, after AxoNN) keeps one outstanding receive per channel
(activations from the previous stage, gradients from the next), identifies micro-batches by
arrival order (each stage runs its forwards and its backwards in micro-batch order, so the k-th
message on a channel is micro-batch k) and polls for completion: `Work.is_completed()` on NCCL;
gloo's irecv only reports completion through `wait()`, so there a waiter thread per channel (two
at most) stands in for the poll. Each direction of each stage boundary travels on its own process
group (`async_groups`), so no stream ever holds a send behind a receive; `checker.check_async_nccl`
explores the mode's interleavings under the same semantics.

Micro-batch losses are lm_loss / N, so the gradients accumulated over the N micro-batches equal
the full-batch gradient. Chimera's two copies of a stage exchange gradients at the end of the step
(one group per rank, after its pipeline messages); both copies then hold the sum and take
identical optimizer steps.

Split backward (chimera-zb, trainer/pipeline/split.py): a split stage's forward runs its linear
layers so that their backward returns only the input gradient and records (input, output
gradient); B is one ordinary backward (the input gradient to send, plus the cheap non-linear
parameter gradients) and W turns the records into weight gradients with one matmul per linear,
so B + W costs one backward and W makes no autograd call. The first stage, whose input needs no
gradient, has nothing to compute in B and runs its whole backward in W.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.models import lm_loss
from trainer.pipeline.actions import Action, Schedule, async_cap
from trainer.pipeline.schedules import Msg, Post, Run, async_next, lower
from trainer.pipeline.split import Record, defer_weight_grads, param_ids, plain_linears, weight_grads


@dataclass(kw_only=True, slots=True)
class StepRecord:
    loss: float
    """Sum over this rank's last-stage micro-batches of loss / N (all-reduce it for the total)."""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    peak_stash: int = 0


@dataclass(slots=True)
class _Stashed:
    """What a forward leaves for its backward: the stage input (None on the first stage), the
    output (or the scaled loss on the last stage) and, between a split B and its W, what W needs:
    the output gradient (first stage) or the deferred linear-layer records (`split.Record`)."""

    inp: torch.Tensor | None
    out: torch.Tensor | None
    grad_out: torch.Tensor | None = None
    records: list[Record] | None = None


def async_groups(ranks: list[int]) -> list[Any]:
    """The four process groups of the message-driven mode: activations crossing boundary
    s -> s+1 travel on group `s % 2`, gradients crossing it back on group `2 + s % 2`. On every
    rank each group then carries either sends to one peer or receives from one peer, so a pending
    receive never holds up a send on the same NCCL stream. Only the pipeline's ranks call this
    (`use_local_synchronization`), in the same order, so it composes with other meshes."""
    return [dist.new_group(ranks, use_local_synchronization=True) for _ in range(4)]


class _Channel:
    """One incoming channel of the message-driven mode: at most one receive outstanding, the k-th
    message is micro-batch k. `ready()` polls without blocking."""

    def __init__(
        self,
        *,
        src: int,
        group: Any,
        count: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        wake: threading.Condition,
    ) -> None:
        self.src, self.group, self.count = src, group, count
        self.shape, self.dtype, self.device = shape, dtype, device
        self.wake = wake
        self.taken = 0
        self.buf: torch.Tensor | None = None
        self.work: Any = None
        # gloo's Work.is_completed() stays False until someone waits, so a thread waits for it
        self.threaded = device.type == "cpu"
        self.arrived = False
        self.error: BaseException | None = None
        self._post()

    def _post(self) -> None:
        if self.taken >= self.count:
            self.work = None
            return
        self.buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.arrived = False
        self.work = dist.irecv(self.buf, src=self.src, group=self.group)
        if self.threaded:
            threading.Thread(target=self._watch, args=(self.work,), daemon=True).start()

    def _watch(self, work: Any) -> None:
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
        with self.wake:
            self.arrived = True
            self.wake.notify_all()

    def ready(self) -> bool:
        if self.work is None:
            return False
        if self.error is not None:
            raise self.error
        return self.arrived if self.threaded else bool(self.work.is_completed())

    def take(self) -> tuple[int, torch.Tensor]:
        """The next micro-batch's tensor, identified by arrival order; posts the next receive."""
        if not self.threaded:
            self.work.wait()  # NCCL: orders the compute stream after the receive
        mb, buf = self.taken, self.buf
        self.taken += 1
        self._post()
        return mb, buf


class PipelineDriver:
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
        channel_groups: list[Any] | None = None,
    ) -> None:
        """`ranks` maps pipeline rank to global rank (default identity); `group` is the process
        group the static schedules talk on (default WORLD); `channel_groups` are the message-
        driven mode's groups (default: `async_groups(ranks)`, made here, so every pipeline rank
        must build its driver at the same point); `delay(action)` returns seconds to sleep
        before the action's compute (jitter injection for tests and benches); `loss_fn(outputs,
        targets)` is the model recipe's mean loss of one micro-batch."""
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
        if sched.dynamic:
            if sched.replicas != 1 or sched.split_backward:
                raise ValueError("the message-driven mode runs one replica with a whole backward")
            self.program: list[Post | Run] = []
            self.channel_groups = channel_groups if channel_groups is not None else async_groups(self.ranks)
        else:
            self.program = lower(sched)[rank]
            self.channel_groups = []
        # split backward: the parameters whose linear-layer weight gradients W computes
        self.deferrable = {k: param_ids(m) for k, m in modules.items()} if sched.split_backward else {}
        self.linears = {k: plain_linears(m) for k, m in modules.items()} if sched.split_backward else {}

    def close(self) -> None:
        """Nothing outlives a step; kept so callers can release a driver explicitly."""

    def _peer(self, *, stage: int, replica: int) -> int:
        return self.ranks[self.sched.rank_of(stage=stage, replica=replica)]

    def step(self, x_BT: torch.Tensor, y_BT: torch.Tensor, *, t0: float | None = None) -> StepRecord:
        """Run this rank's share of one step; parameter gradients are left in `.grad`."""
        N = self.sched.microbatches
        t0 = time.perf_counter() if t0 is None else t0
        run = _StepRun(self, xs=x_BT.to(self.device).chunk(N), ys=y_BT.to(self.device).chunk(N), t0=t0)
        if self.sched.dynamic:
            run.message_driven()
        else:
            run.static()
        run.finish()
        return StepRecord(loss=run.loss.item(), timeline=run.timeline, peak_stash=run.peak_stash)


class _StepRun:
    """The mutable state of one step on one rank."""

    def __init__(
        self, ex: PipelineDriver, *, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...], t0: float
    ) -> None:
        self.ex = ex
        self.xs, self.ys = xs, ys
        self.t0 = t0
        self.stash: dict[tuple[int, int, int], _Stashed] = {}
        self.peak_stash = 0
        # the loss stays on the device until the step ends: no CPU sync inside the step
        self.loss = torch.zeros((), dtype=torch.float64, device=ex.device)
        self.timeline: list[dict[str, Any]] = []
        self.outbox: dict[Msg, torch.Tensor] = {}
        self.inbox: dict[Msg, tuple[Any, torch.Tensor]] = {}
        self.sent: list[tuple[Any, torch.Tensor]] = []
        self.flat: dict[tuple[int, int], torch.Tensor] = {}

    # ---- static schedules -------------------------------------------------------------------
    def static(self) -> None:
        for ins in self.ex.program:
            if isinstance(ins, Post):
                self._post(ins)
                continue
            inputs = []
            for m in ins.needs:
                work, buf = self.inbox.pop(m)
                work.wait()
                inputs.append(buf)
            if ins.action is None:
                self._sum_exchanged(dict(zip(ins.needs, inputs, strict=True)))
            elif ins.action.op == "AR":
                self._flatten(ins.action, ins.sends[0])
            else:
                out = self.compute(ins.action, inputs[0] if inputs else None)
                for m in ins.sends:
                    self.outbox[m] = out

    def _post(self, post: Post) -> None:
        """One `batch_isend_irecv` per group; no tags (P2POp's default tag 0 everywhere)."""
        ex = self.ex
        ops, tensors = [], []
        for op in post.ops:
            m = op.msg
            if op.op == "send":
                t = self.outbox.pop(m).contiguous()
                ops.append(dist.P2POp(dist.isend, t, ex.ranks[m.dst], group=ex.group))
            else:
                t = torch.empty(self._shape(m), dtype=ex.act_dtype, device=ex.device)
                ops.append(dist.P2POp(dist.irecv, t, ex.ranks[m.src], group=ex.group))
            tensors.append(t)
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):
            # a coalesced backend (NCCL) hands back one work for the whole group
            works = works * len(ops) if len(works) == 1 else works
        for op, work, t in zip(post.ops, works, tensors, strict=True):
            if op.op == "send":
                self.sent.append((work, t))  # the tensor lives until the send completes
            else:
                self.inbox[op.msg] = (work, t)

    def _shape(self, m: Msg) -> tuple[int, ...]:
        if m.kind == "ar":
            return (sum(p.numel() for p in self.ex.modules[(m.stage, m.replica)].parameters()),)
        return self.ex.act_shape

    def _flatten(self, a: Action, msg: Msg) -> None:
        """This stage copy's gradients are final: flatten them for the other copy."""
        start = time.perf_counter()
        params = list(self.ex.modules[(a.stage, a.replica)].parameters())
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        self.flat[(a.stage, a.replica)] = flat
        self.outbox[msg] = flat
        self._record(a, start)

    def _sum_exchanged(self, got: dict[Msg, torch.Tensor]) -> None:
        """Both copies of a stage end with the sum of their gradients."""
        for m, other in got.items():
            key = (m.stage, m.replica)
            total = self.flat.pop(key) + other
            offset = 0
            for p in self.ex.modules[key].parameters():
                n = p.numel()
                p.grad = total[offset : offset + n].view_as(p).clone()
                offset += n

    # ---- compute ----------------------------------------------------------------------------
    def _record(self, a: Action, start: float) -> None:
        self.timeline.append(
            {
                "rank": self.ex.rank,
                "op": a.op,
                "mb": a.mb,
                "stage": a.stage,
                "replica": a.replica,
                "start": start - self.t0,
                "end": time.perf_counter() - self.t0,
            }
        )

    def compute(self, a: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        """Run F, B or W; returns the tensor to send on (activation or input gradient), if any."""
        ex = self.ex
        D, N = ex.sched.stages, ex.sched.microbatches
        key = (a.mb, a.stage, a.replica)
        mod = ex.modules[(a.stage, a.replica)]
        start = time.perf_counter()
        if ex.delay is not None:
            # injected inside the timed span: it stands for slower compute, not a late message
            time.sleep(ex.delay(a))
        send: torch.Tensor | None = None
        if a.op == "F":
            inp = None if a.stage == 0 else received.requires_grad_()
            records: list[Record] | None = None
            defer: Any = nullcontext()
            if inp is not None and ex.sched.split_backward:  # the linear weight gradients wait for W
                records = []
                k = (a.stage, a.replica)
                defer = defer_weight_grads(mod, ex.deferrable[k], records, ex.linears[k])
            with defer:
                out = mod(self.xs[a.mb] if inp is None else inp)
            if a.stage == D - 1:
                # note: scaled by 1/N so the N micro-batch gradients sum to the full-batch one
                out = self.ex.loss_fn(out, self.ys[a.mb]) / N
                self.loss += out.detach().double()
            else:
                send = out.detach()
            self.stash[key] = _Stashed(inp=inp, out=out, records=records)
            self.peak_stash = max(self.peak_stash, len(self.stash))
        elif a.op == "B":
            st = self.stash[key]
            grad = None if a.stage == D - 1 else received
            if st.inp is None and ex.sched.split_backward:
                st.grad_out = grad  # nothing upstream: the whole backward runs in W
            else:
                # split: the linear weight gradients are deferred to W (records)
                torch.autograd.backward(st.out, grad_tensors=grad)
                send = st.inp.grad if st.inp is not None else None
                if st.records is None:
                    del self.stash[key]
                else:
                    st.inp = st.out = None  # the graph is freed; W needs only the records
        elif a.op == "W":
            st = self.stash.pop(key)
            if st.records is None:
                torch.autograd.backward(st.out, grad_tensors=st.grad_out)
            else:
                weight_grads(st.records)
        self._record(a, start)
        return send

    # ---- message-driven mode ----------------------------------------------------------------
    def message_driven(self) -> None:
        """AxoNN-style: act on whatever has arrived, gradients first; poll, never block on one
        receive while another could be served."""
        ex = self.ex
        D, N = ex.sched.stages, ex.sched.microbatches
        s = ex.rank  # one replica: stage s on rank s
        groups = ex.channel_groups
        wake = threading.Condition()
        common = {"count": N, "shape": ex.act_shape, "dtype": ex.act_dtype, "device": ex.device, "wake": wake}
        act_in = _Channel(src=ex.ranks[s - 1], group=groups[(s - 1) % 2], **common) if s > 0 else None
        grad_in = _Channel(src=ex.ranks[s + 1], group=groups[2 + s % 2], **common) if s < D - 1 else None
        f_done = b_done = 0
        while b_done < N:
            # decide under the channels' lock: an arrival between the poll and the wait wakes it
            with wake:
                op = async_next(
                    stage=s,
                    stages=D,
                    microbatches=N,
                    cap=ex.cap,
                    f_done=f_done,
                    b_done=b_done,
                    grad_ready=grad_in is not None and grad_in.ready(),
                    act_ready=act_in is not None and act_in.ready(),
                )
                if op is None:
                    # gloo: a channel thread notifies; NCCL: poll again shortly
                    wake.wait(timeout=1e-4 if ex.device.type != "cpu" else 1.0)
                    continue
            got = None
            if op == "B":
                mb = b_done
                if s < D - 1:
                    mb, got = grad_in.take()
            else:
                mb = f_done
                if s > 0:
                    mb, got = act_in.take()
            a = Action(op, mb, s)
            out = self.compute(a, got)
            if a.op == "F":
                f_done += 1
                if s < D - 1:
                    self._isend(out, dst=ex.ranks[s + 1], group=groups[s % 2])
            else:
                b_done += 1
                if s > 0:
                    self._isend(out, dst=ex.ranks[s - 1], group=groups[2 + (s - 1) % 2])

    def _isend(self, t: torch.Tensor, *, dst: int, group: Any) -> None:
        t = t.contiguous()
        self.sent.append((dist.isend(t, dst=dst, group=group), t))

    def finish(self) -> None:
        for work, _ in self.sent:
            work.wait()
        self.sent.clear()
