"""AxoNN-style offloaded mixed-precision AdamW.

The device holds only the low-precision (bf16/fp16) parameters and gradients, ~4 bytes/param. The
fp32 master weights and both Adam moments live in pinned host memory. A step streams them through
the device in buckets, each bucket: copy master/m/v in -> take the gradient slice in fp32, unscale
(and clip) -> AdamW update -> write the low-precision parameter -> copy master/m/v (and the new
low-precision value, for spilled shards) back. Two bucket buffer sets alternate so the copy of
bucket i+1 (copy stream) overlaps the update of bucket i (compute stream).

Parameters are grouped (one group per spilled shard, or one for the whole model); each group is a
flat buffer, so a bucket is a plain slice. The update is the same arithmetic, op for op, as
`torch.optim.AdamW`'s single-tensor path, so fp32 mode matches it to the last bit on CPU.

fp16 needs dynamic loss scaling (`LossScaler`): an inf/NaN gradient skips the step and halves the
scale; `growth_interval` clean steps double it. bf16 and fp32 use a fixed scale of 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.spill.ledger import DeviceLedger

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BUFFERS_PER_SET = 5  # master, exp_avg, exp_avg_sq, fp32 gradient, denominator
BUCKET_SETS = 2


class NonFiniteGradient(RuntimeError):
    """A non-finite gradient without dynamic loss scaling: a terminal failure of the run."""


@dataclass(kw_only=True, slots=True)
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0
    skipped_steps: int = 0

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> LossScaler:
        if dtype == torch.float16:
            return cls(scale=2.0**16, dynamic=True)
        return cls()

    def update(self, *, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


def bucket_bytes(bucket_numel: int) -> int:
    """Device bytes of the offload bucket buffers (held for the whole run)."""
    return BUCKET_SETS * BUFFERS_PER_SET * 4 * bucket_numel


class OffloadedAdamW:
    """AdamW over flat parameter groups whose fp32 state is in host memory.

    `masters[g]` is group g's fp32 master flat buffer in host memory (the spilled shard's own host
    copy; updated in place). The caller owns the device low-precision parameter and gradient flat
    buffers and passes them to `step_group`."""

    def __init__(
        self,
        *,
        masters: list[torch.Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        dtype: torch.dtype,
        device: torch.device,
        bucket_numel: int,
        ledger: DeviceLedger,
        copy_stream: torch.cuda.Stream | None = None,
        scaler: LossScaler | None = None,
    ) -> None:
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.dtype, self.device = dtype, device
        self.masters = masters
        pin = torch.cuda.is_available()
        self.exp_avg = [torch.zeros(m.numel(), pin_memory=pin) for m in masters]
        self.exp_avg_sq = [torch.zeros(m.numel(), pin_memory=pin) for m in masters]
        self.host_lp = [torch.empty(m.numel(), dtype=dtype, pin_memory=pin) for m in masters]
        for lp, m in zip(self.host_lp, masters, strict=True):
            lp.copy_(m)
        self.steps = [0] * len(masters)
        self.bucket_numel = bucket_numel
        self.copy_stream = copy_stream
        self.scaler = scaler or LossScaler.for_dtype(dtype)
        self.ledger = ledger
        self._sets = [
            [torch.empty(bucket_numel, device=device) for _ in range(BUFFERS_PER_SET)]
            for _ in range(BUCKET_SETS)
        ]
        ledger.hold("offload.buckets", bucket_bytes(bucket_numel))

    @property
    def device_bytes(self) -> int:
        """Bytes of the device buffers this optimizer holds, read off the buffers themselves."""
        return sum(t.untyped_storage().nbytes() for bufs in self._sets for t in bufs)

    def _chunks(self, grads: torch.Tensor) -> list[torch.Tensor]:
        return [grads[a : a + self.bucket_numel] for a in range(0, grads.numel(), self.bucket_numel)]

    # note: `.item()` is a CPU-GPU sync point, once per group and step; the skip decision needs it
    def found_inf(self, grads: torch.Tensor) -> bool:
        # bucket by bucket: isfinite makes temporaries the size of its input (abs, compares), which
        # on the whole flat gradient would be another 2 bytes/param on the device
        finite = torch.stack([torch.isfinite(c).all() for c in self._chunks(grads)])
        return not bool(finite.all().item())

    def grad_sq_norm(self, grads: torch.Tensor) -> float:
        """Sum of squares of the unscaled gradient (for global-norm clipping); in fp32, a bucket at a
        time (a whole fp32 copy of the gradient would be 4 bytes/param on the device)."""
        sq = torch.stack([torch.dot(c32, c32) for c32 in (c.float() for c in self._chunks(grads))]).sum()
        return float(sq.item()) / (self.scaler.scale**2)

    @torch.no_grad()
    def step_group(
        self, g: int, *, params: torch.Tensor, grads: torch.Tensor, clip_coef: float = 1.0
    ) -> None:
        """One AdamW step of group g. `params` and `grads` are the device low-precision flat
        buffers; `params` is rewritten from the updated masters."""
        self.steps[g] += 1
        step = float(self.steps[g])
        beta1, beta2 = self.betas
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = self.lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        grad_mult = clip_coef / self.scaler.scale
        n = params.numel()
        host = (self.masters[g], self.exp_avg[g], self.exp_avg_sq[g])
        ranges = [(a, min(a + self.bucket_numel, n)) for a in range(0, n, self.bucket_numel)]
        stream = self.copy_stream
        compute = torch.cuda.current_stream(self.device) if stream is not None else None
        ready: list[torch.cuda.Event | None] = [None] * len(ranges)

        def copy_in(i: int) -> None:
            a, b = ranges[i]
            bufs = self._sets[i % BUCKET_SETS]
            if stream is None:
                for dst, src in zip(bufs[:3], host, strict=True):
                    dst[: b - a].copy_(src[a:b])
                return
            with torch.cuda.stream(stream):
                for dst, src in zip(bufs[:3], host, strict=True):
                    dst[: b - a].copy_(src[a:b], non_blocking=True)
                ready[i] = torch.cuda.Event()
                ready[i].record(stream)

        def copy_out(i: int) -> None:
            a, b = ranges[i]
            bufs = self._sets[i % BUCKET_SETS]
            if stream is None:
                for src, dst in zip(bufs[:3], host, strict=True):
                    dst[a:b].copy_(src[: b - a])
                self.host_lp[g][a:b].copy_(params[a:b])
                return
            stream.wait_stream(compute)  # the update of this bucket must be done
            with torch.cuda.stream(stream):
                for src, dst in zip(bufs[:3], host, strict=True):
                    dst[a:b].copy_(src[: b - a], non_blocking=True)
                self.host_lp[g][a:b].copy_(params[a:b], non_blocking=True)

        if stream is not None:
            stream.wait_stream(compute)  # gradients of this group are complete
            # the write-back of the low-precision values reads `params` on the copy stream: a
            # spill right after this step must not hand its memory out before that is done
            params.record_stream(stream)
        copy_in(0)
        for i, (a, b) in enumerate(ranges):
            # prefetch the next bucket while this one updates (the other buffer set)
            if i + 1 < len(ranges):
                copy_in(i + 1)
            if ready[i] is not None:
                compute.wait_event(ready[i])
            master, m, v, g32, denom = (t[: b - a] for t in self._sets[i % BUCKET_SETS])
            g32.copy_(grads[a:b])
            if grad_mult != 1.0:
                g32.mul_(grad_mult)
            # the same ops, in the same order, as torch.optim.AdamW (single-tensor path)
            if self.weight_decay != 0:
                master.mul_(1 - self.lr * self.weight_decay)
            m.lerp_(g32, 1 - beta1)
            v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            torch.sqrt(v, out=denom)
            denom.div_(bias_correction2_sqrt).add_(self.eps)
            master.addcdiv_(m, denom, value=-step_size)
            params[a:b].copy_(master)
            copy_out(i)

    def state_by_name(self, g: int, names: list[str], views: list[slice]) -> dict[str, dict]:
        return {
            name: {
                "step": self.steps[g],
                "exp_avg": self.exp_avg[g][sl].clone(),
                "exp_avg_sq": self.exp_avg_sq[g][sl].clone(),
            }
            for name, sl in zip(names, views, strict=True)
        }

    def load_by_name(self, g: int, state: dict[str, dict], names: list[str], views: list[slice]) -> None:
        for name, sl in zip(names, views, strict=True):
            st = state[name]
            self.exp_avg[g][sl].copy_(st["exp_avg"].reshape(-1))
            self.exp_avg_sq[g][sl].copy_(st["exp_avg_sq"].reshape(-1))
            self.steps[g] = int(st["step"])
        self.host_lp[g].copy_(self.masters[g])
