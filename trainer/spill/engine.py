"""HYDRA model spilling: train a model whose parameters, gradients and optimizer state exceed the
device budget, one shard at a time, with the next shard copied in while the current one computes.

API note (for reuse, e.g. shard alternation across devices in model-selection batches):

    costs = measure_layers(model, batch_size=B, seq_len=T, state_bpp=8)        # partition.py
    plan = partition(costs, budget_bytes=budget, prefetch=True)                 # or cuts=[...]
    engine = SpillEngine(model, plan=plan, train=job.train, device=dev, ledger=DeviceLedger(...))
    loss = engine.train_step(x_BT, y_BT)      # forward, recompute-backward and per-shard steps
    engine.eval_loss(x_BT, y_BT); engine.state_dict(); engine.load_state_dict(sd)
    engine.release()                          # spill everything: the device holds nothing

    Shard (shard.py), the unit a scheduler moves between devices:
      shard.to_device(state=...)  start the copy in (side stream on CUDA); shard.ready() before use
      shard.forward(x)            no-grad forward (the boundary output is all that is kept)
      shard.backward(x_in, grad_out=... | target=...)  recompute from the saved boundary input, then
                                  backpropagate; returns (grad of x_in, loss)
      shard.step()                plain optimizer step (state resident); offload: engine.step_shard
      shard.spill()               write back what changed, free the device copies
    A shard's host copy is the truth while it is spilled, so moving a model to another device is
    `engine.release()` then a new SpillEngine(..., device=other) over the same layers, or, shard
    by shard, spill on one device and `to_device` on another (change `shard.device`).

Step schedule, K shards (prefetch on; off = the same without overlap):
    forward   shard 0..K-2 with no grad: prefetch k+1, run k, keep the boundary output (host memory
              when the next shard that needs it is not resident), spill k. With prefetch, shard K-2
              stays and its state follows, because the backward needs it next.
    last      shard K-1: forward with grad, loss, backward, optimizer step, while K-2 finishes
              arriving.
    backward  k = K-2..0: spill k+1, prefetch k-1 (params + optimizer state + boundary input),
              recompute k from its boundary input, backward, step k at once, so at most one
              shard's optimizer state (plus the prefetched one) is ever on the device.
    Shard 0 ends the step resident and starts the next one without a copy.

Global-norm gradient clipping and fp16 dynamic loss scaling need every gradient before any step.
With more than one shard they take the deferred path: each shard's gradients are parked in host
memory after its backward, the decision (norm, inf) is made once, then shard 0 steps where it is
and shards 1..K-1 come back in turn (with prefetch) to step. One more pass over the shards per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from jobrules.parallel import HOST_STEPS_WITH_OFFLOAD
from jobrules.spec import OffloadSpec, SpecError, TrainSpec
from trainer.models import lm_loss
from trainer.optim import build_optimizer
from trainer.spill.host_step import HostSteps, state_keys
from trainer.spill.ledger import DeviceLedger
from trainer.spill.offload import DTYPES, NonFiniteGradient, OffloadedAdamW
from trainer.spill.partition import SpillPlan, state_bytes_per_param
from trainer.spill.shard import Shard


def anchor_fits(plan: SpillPlan, train: TrainSpec, *, n_shards: int) -> bool:
    """Host mode: whether shard 0 can stay on the device for good, with its gradients and its
    optimizer state, on top of the plan's peak (which counts it only while it works). Counted in
    full beside every other shard's working set, so the ledger's budget holds."""
    if n_shards == 1:
        return True
    if plan.budget_bytes is None:
        return True
    a, b = plan.bounds[0]
    numel = sum(c.numel for c in plan.costs[a:b])
    state = state_bytes_per_param(optimizer=train.optimizer, momentum=train.momentum, offload=False)
    return plan.peak_bytes + numel * (4 + 4 + state) + plan.costs[a].in_bytes <= plan.budget_bytes


def default_bucket_numel(model: nn.Module) -> int:
    """Offload bucket: 1/128 of the model's parameters, so the bucket buffers (40 bytes/element)
    add ~0.31 byte/param (4.31 bytes/param in all with bf16); at least 1024 and at most 4M
    elements (160 MiB)."""
    total = sum(p.numel() for p in model.parameters())
    return max(1024, min(4 * 2**20, total // 128))


class SpillEngine:
    def __init__(
        self,
        model: nn.Sequential,
        *,
        plan: SpillPlan,
        train: TrainSpec,
        device: torch.device,
        ledger: DeviceLedger,
        prefetch: bool = True,
        offload: OffloadSpec | None = None,
        bucket_numel: int | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
        host_step: bool = False,
    ) -> None:
        self.device, self.ledger, self.prefetch, self.train = device, ledger, prefetch, train
        self.loss_fn = loss_fn  # the model recipe's mean loss
        self.plan = plan
        self.offloaded = offload is not None and offload.optimizer
        self.param_dtype = DTYPES[offload.dtype] if self.offloaded else torch.float32
        n_shards = plan.n_shards
        if self.offloaded and train.optimizer != "adamw":
            raise SpecError(
                f"parallel.offload.optimizer streams AdamW state; train.optimizer is {train.optimizer!r}"
            )
        if host_step and self.offloaded:
            raise SpecError(HOST_STEPS_WITH_OFFLOAD)
        # Global-norm clipping and the fp16 inf check need every gradient before any step: with
        # several shards the steps then wait for the whole backward (gradients parked in host
        # memory, one more pass over the shards), instead of following each shard's backward.
        self.deferred = n_shards > 1 and (train.grad_clip > 0 or self.param_dtype == torch.float16)
        self._norms: dict[int, Any] = {}
        self._boundary = [0, 0]  # boundary activations copied in, and out (bytes_moved)
        # one side stream for all host<->device copies: shard prefetch (when on) and the offloaded
        # optimizer's buckets (always on CUDA: they overlap the update of the previous bucket)
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copy_stream = side if prefetch else None
        self.side_stream = side
        if plan.reserved_bytes:
            # the math libraries' workspaces (partition.library_workspace_bytes): held by the device
            # for the whole run, though no tensor of ours holds them
            ledger.hold("library.workspace", plan.reserved_bytes)
        self.shards = Shard.cut(
            model,
            plan.bounds,
            device=device,
            param_dtype=self.param_dtype,
            ledger=ledger,
            copy_stream=self.copy_stream,
        )
        self.opt: OffloadedAdamW | None = None
        self.host: HostSteps | None = None
        self.anchor = host_step and anchor_fits(plan, train, n_shards=n_shards)
        """Host mode: shard 0 stays on the device with its state and steps there. It is the last
        backward and the first forward, so a host step of it could overlap nothing."""
        if self.offloaded:
            self.opt = OffloadedAdamW(
                masters=[s.host for s in self.shards],
                lr=train.lr,
                weight_decay=train.weight_decay,
                dtype=self.param_dtype,
                device=device,
                bucket_numel=bucket_numel or default_bucket_numel(model),
                ledger=ledger,
                copy_stream=self.side_stream,
            )
            for s in self.shards:
                s.offload = self.opt
        else:
            keys = state_keys(train)
            on_host = [s for s in self.shards if host_step and not (self.anchor and s.index == 0)]
            for s in self.shards:
                if s not in on_host:
                    s.attach_optimizer(build_optimizer(s.params, train), state_keys=keys)
            if on_host:
                self.host = HostSteps(on_host, train=train, device=device)

    def _on_host(self, shard: Shard) -> bool:
        return self.host is not None and shard.opt is None

    def _bring(self, shard: Shard, *, state: bool) -> None:
        """`to_device`, once a host step of the shard has written its host copy."""
        if self.host is not None:
            self.host.wait(shard.index)
        shard.to_device(state=state)

    # -- movement helpers -------------------------------------------------------------------------
    def _hold_input(self, k: int, x: torch.Tensor) -> torch.Tensor:
        self.ledger.hold(f"in{k}", x.numel() * x.element_size())
        return x

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        """Copy a boundary tensor in. On CUDA it goes on the copy stream ahead of the next
        `to_device`, whose ready event then covers it too."""
        dst = torch.empty(x.shape, dtype=x.dtype, device=self.device)
        self._boundary[0] += x.numel() * x.element_size()
        return self._copy(dst, x, on_device=dst)

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        """The boundary activation goes to host memory; the device copy can then be freed."""
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.device.type == "cuda")
        self._boundary[1] += x.numel() * x.element_size()
        return self._copy(host, x, on_device=x)

    def bytes_moved(self) -> tuple[int, int]:
        """(to the device, back to the host) in bytes since the engine was made: the shards'
        weights, state and gradients and the boundary activations. The offloaded optimizer's
        buckets are not counted."""
        return (
            self._boundary[0] + sum(s.bytes_in for s in self.shards),
            self._boundary[1] + sum(s.bytes_out for s in self.shards),
        )

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, *, on_device: torch.Tensor) -> torch.Tensor:
        """`dst` with `src` copied in. On CUDA the copy waits for the work queued so far and runs on
        the copy stream; `on_device` (the side of the copy in device memory) is marked as used
        there, so that its memory is not reused before the copy has run."""
        if self.copy_stream is None:
            dst.copy_(src)
            return dst
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
        on_device.record_stream(self.copy_stream)
        return dst

    @property
    def loss_scale(self) -> float:
        return self.opt.scaler.scale if self.opt is not None else 1.0

    def resident(self) -> list[int]:
        return [s.index for s in self.shards if s.resident]

    # -- the step ---------------------------------------------------------------------------------
    def step_shard(self, shard: Shard) -> None:
        """Optimizer step of one shard right after its backward; its gradients are then freed."""
        if self._on_host(shard):
            assert self.host is not None
            self.host.launch(shard, events=self.host.copy_out(shard))
            shard.spill()  # frees the gradient; stale once the host steps it: its next use copies the new weights in
            return
        if self.opt is None:
            if self.train.grad_clip > 0:  # one shard (more shards take the deferred path)
                torch.nn.utils.clip_grad_norm_(shard.params, self.train.grad_clip)
            shard.step()
        else:
            assert shard.dev is not None and shard.dev_grad is not None
            scaler = self.opt.scaler
            found_inf = self.opt.found_inf(shard.dev_grad)
            if found_inf and not scaler.dynamic:
                raise NonFiniteGradient(
                    f"non-finite gradient in shard {shard.index} (layers {shard.start}..{shard.stop - 1})"
                )
            if not found_inf:
                coef = 1.0
                if self.train.grad_clip > 0:
                    norm = math.sqrt(self.opt.grad_sq_norm(shard.dev_grad))
                    coef = min(1.0, self.train.grad_clip / (norm + 1e-6))
                self.opt.step_group(shard.index, params=shard.dev, grads=shard.dev_grad, clip_coef=coef)
                if self.copy_stream is None and self.side_stream is not None:
                    # without prefetch the next copy-in runs on the compute stream: it must see
                    # the low-precision values the buckets are still writing back
                    torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
            if len(self.shards) == 1 or scaler.dynamic:
                scaler.update(found_inf=found_inf)
        shard.drop_grads()

    def _after_backward(self, shard: Shard) -> None:
        if not self.deferred:
            self.step_shard(shard)
            return
        g = shard.dev_grad
        assert g is not None
        if self.opt is None:
            # per-parameter norms, as torch.nn.utils.clip_grad_norm_ computes them
            self._norms[shard.index] = [torch.linalg.vector_norm(v, 2.0) for v in shard.views(g)]
        else:
            g32 = g.float()
            self._norms[shard.index] = (torch.isfinite(g).all(), torch.dot(g32, g32))
        if self._on_host(shard):
            assert self.host is not None
            self.host.copy_out(shard)  # the deferred step waits for the copy stream as a whole
            shard.spill()  # frees the gradient
        elif shard.index != 0:  # shard 0 is the last backward: it steps without leaving
            shard.stash_grads()

    def _deferred_step(self) -> None:
        """Decide from all gradients (one sync point), then step shard 0 (resident) and bring the
        others back one by one, each with its parked gradients."""
        shards, K, clip = self.shards, len(self.shards), self.train.grad_clip
        norms, self._norms = self._norms, {}
        found_inf, coef = False, None
        if self.opt is None:
            per_param = [n for k in range(K) for n in norms[k]]
            total = torch.linalg.vector_norm(torch.stack([n.cpu() for n in per_param]), 2.0)
            coef = torch.clamp(clip / (total + 1e-6), max=1.0)
        else:
            found_inf = not all(bool(f.item()) for f, _ in norms.values())
            if found_inf and not self.opt.scaler.dynamic:
                raise NonFiniteGradient("non-finite gradient")
            self.opt.scaler.update(found_inf=found_inf)
            if clip > 0 and not found_inf:
                norm = math.sqrt(sum(float(sq.item()) for _, sq in norms.values())) / self.opt.scaler.scale
                coef = min(1.0, clip / (norm + 1e-6))
        if found_inf:  # skip the step everywhere; the parked gradients are overwritten next time
            shards[0].drop_grads()
            return
        if self.host is not None:
            self._deferred_host_step(coef)
            return
        self._apply_step(shards[0], coef)
        for k in range(1, K):
            shards[k - 1].spill()
            shards[k].to_device(state=True, grads=True)
            if self.prefetch and k + 1 < K:
                shards[k + 1].to_device(state=True)
            shards[k].ready()
            self._apply_step(shards[k], coef)
        shards[K - 1].spill()

    def _deferred_host_step(self, coef: Any) -> None:
        """Host mode: the anchor steps where it is; every other shard's gradient is in host memory
        (once the copy stream is done) and steps there, scaled by the clipping coefficient."""
        assert self.host is not None
        if self.host.d2h is not None:
            self.host.d2h.synchronize()
        for shard in self.shards:
            if self._on_host(shard):
                self.host.launch(shard, coef=coef)
            else:
                self._apply_step(shard, coef)

    def _apply_step(self, shard: Shard, coef: Any) -> None:
        assert shard.dev is not None and shard.dev_grad is not None
        if self.opt is None:
            if coef is not None:
                shard.dev_grad.mul_(coef.to(self.device))
            shard.step()
        else:
            mult = 1.0 if coef is None else float(coef)
            self.opt.step_group(shard.index, params=shard.dev, grads=shard.dev_grad, clip_coef=mult)
            if self.copy_stream is None and self.side_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
        shard.drop_grads()

    def train_step(self, x_BT: torch.Tensor, y_BT: torch.Tensor) -> float:
        """One optimizer step on the batch; returns the loss (a sync point)."""
        self.ledger.new_step()
        shards, K = self.shards, len(self.shards)
        y_BT = y_BT.to(self.device)
        self.ledger.hold("targets", y_BT.numel() * y_BT.element_size())
        # boundary inputs of the shards the backward recomputes: host copies, device copies
        host_in: dict[int, torch.Tensor] = {0: x_BT}
        dev_in: dict[int, torch.Tensor] = {}
        h = self._hold_input(0, self._to_device(x_BT))
        self._bring(shards[0], state=K == 1 or self.anchor)
        for k in range(K - 1):
            nxt = shards[k + 1]
            last_state = k + 1 == K - 1  # the last shard steps without leaving
            if self.prefetch and (self.host is None or self.host.done(nxt.index)):
                # prefetch the next shard while this one computes (its copy waits for the work
                # queued before it, so it goes ahead of this shard's forward)
                nxt.to_device(state=last_state)
            shards[k].ready()
            out = self._hold_input(k + 1, shards[k].forward(h))
            if self.prefetch:
                # a next shard still stepping on the host comes in once this forward is queued:
                # waiting for it must not hold the forward back (a no-op when it came in above)
                self._bring(nxt, state=last_state)
            # with prefetch, shard K-2 stays resident from its forward to its backward; the
            # anchor (host mode) stays for good
            keep = (self.prefetch and k == K - 2) or (self.anchor and k == 0)
            if k + 1 < K - 2 or (not self.prefetch and k + 1 == K - 2):
                host_in[k + 1] = self._to_host(out)  # needed again only by its recompute
            if keep:
                # the backward needs this shard next: keep it and its input, bring its state in
                dev_in[k] = h
                shards[k].to_device(state=True)
            else:
                self.ledger.release(f"in{k}")
                shards[k].spill()
            if not self.prefetch:
                self._bring(nxt, state=last_state)
            h = out

        last = shards[K - 1]
        last.ready()
        grad, loss = last.backward(h, target=y_BT, loss_scale=self.loss_scale, loss_fn=self.loss_fn)
        assert loss is not None
        del h
        self.ledger.release(f"in{K - 1}")
        self._after_backward(last)
        for k in range(K - 2, -1, -1):
            assert grad is not None
            self.ledger.hold(f"in{k + 1}.grad", grad.numel() * grad.element_size())
            shards[k + 1].spill()
            if self.prefetch and k > 0:
                # shard k-1 and its boundary input come in while shard k recomputes
                if k - 1 not in dev_in:  # the anchor's input stayed from the forward
                    dev_in[k - 1] = self._hold_input(k - 1, self._to_device(host_in.pop(k - 1)))
                self._bring(shards[k - 1], state=True)
            if k not in dev_in:
                dev_in[k] = self._hold_input(k, self._to_device(host_in.pop(k)))
            self._bring(shards[k], state=True)  # a no-op when prefetched
            shards[k].ready()
            x_in = dev_in.pop(k)
            # the gradient of this shard's input replaces the upstream one (freed here)
            grad, _ = shards[k].backward(x_in, grad_out=grad)
            del x_in
            self.ledger.release(f"in{k + 1}.grad")
            self.ledger.release(f"in{k}")
            self._after_backward(shards[k])
        if self.deferred:
            self._deferred_step()
        self.ledger.release("targets")
        return float(loss.item())  # note: the step's one CPU-GPU sync point

    @torch.no_grad()
    def eval_loss(self, x_BT: torch.Tensor, y_BT: torch.Tensor) -> float:
        """Loss of a forward pass, shard by shard (leaves shard 0 resident again)."""
        h = self._to_device(x_BT)
        K = len(self.shards)
        for k, shard in enumerate(self.shards):
            self._bring(shard, state=False)
            shard.ready()
            if self.prefetch and k + 1 < K:
                self._bring(self.shards[k + 1], state=False)
            h = shard.forward(h)
            if k + 1 < K and not (self.anchor and k == 0):
                shard.spill()
        loss = self.loss_fn(h, y_BT.to(self.device)).item()
        if K > 1:
            self.shards[-1].spill()
            self._bring(self.shards[0], state=False)
            self.shards[0].ready()
        return loss

    # -- state ------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every copy in flight and every host step (before reading host copies from
        the CPU)."""
        if self.host is not None:
            self.host.wait_all()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            if self.side_stream is not None:
                self.side_stream.synchronize()

    def release(self) -> None:
        for s in self.shards:
            s.spill()
        self.synchronize()

    def close(self) -> None:
        """`release`, and the host steps' thread ends."""
        self.release()
        if self.host is not None:
            self.host.close()

    def model_state(self) -> dict[str, torch.Tensor]:
        """fp32 parameters under the model's own state_dict names."""
        self.synchronize()
        return {
            n: v.detach().to("cpu", copy=True).reshape(shape)
            for s in self.shards
            for n, v, shape in zip(s.names, s.master_values(), s.shapes, strict=True)
        }

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        optim: dict[str, Any] = {}
        for s in self.shards:
            slices = [slice(o, o + sh.numel()) for o, sh in zip(s.offsets, s.shapes, strict=True)]
            if self.opt is not None:
                optim.update(self.opt.state_by_name(s.index, s.names, slices))
                continue
            if self.host is not None and s.opt is None:
                optim.update(self.host.state_by_name(s))
                continue
            assert s.opt is not None
            flats = s.state_dev if s.state_dev is not None else s.state_host
            for i, (name, p) in enumerate(zip(s.names, s.params, strict=True)):
                st: dict[str, Any] = {k: flats[k][slices[i]].cpu().clone() for k in flats}
                if "step" in s.opt.state[p]:
                    st["step"] = float(s.opt.state[p]["step"])
                optim[name] = st
        extra = {"loss_scale": self.opt.scaler.scale} if self.opt is not None else {}
        return {"model": self.model_state(), "optimizer": {"per_param": optim, **extra}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from `state_dict()` (any cuts: state is keyed by parameter name)."""
        self.release()
        model, per_param = sd["model"], sd["optimizer"]["per_param"]
        for s in self.shards:
            for name, view in zip(s.names, s.views(s.host), strict=True):
                view.copy_(model[name])
            slices = [slice(o, o + sh.numel()) for o, sh in zip(s.offsets, s.shapes, strict=True)]
            if self.opt is not None:
                self.opt.load_by_name(s.index, per_param, s.names, slices)
                continue
            if self.host is not None and s.opt is None:
                self.host.load_by_name(s, per_param)
                continue
            assert s.opt is not None
            for name, p, sl in zip(s.names, s.params, slices, strict=True):
                st = per_param[name]
                for k, flat in s.state_host.items():
                    flat[sl].copy_(st[k].reshape(-1))
                if "step" in s.opt.state[p]:
                    s.opt.state[p]["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        if self.opt is not None and "loss_scale" in sd["optimizer"]:
            self.opt.scaler.scale = float(sd["optimizer"]["loss_scale"])
