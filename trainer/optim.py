"""The optimizers a composed engine steps: torch's own (state on the device), or AxoNN-style
offloaded AdamW (trainer/spill/offload.py) over whatever parameters this rank holds: a whole model,
a pipeline stage, a tensor shard. Both expose the same few calls, so the engine never asks which."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jobrules.spec import OffloadSpec, TrainSpec
from trainer.grads import scale_grads_


def build_optimizer(params: Any, cfg: TrainSpec) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


class TorchOptimizer:
    """torch.optim over the rank's parameters; the checkpoint keeps torch's own state_dict format
    (what trainer/loop.py always wrote, and what a selection trial warm-starts from)."""

    offloaded = False

    def __init__(self, named: list[tuple[str, nn.Parameter]], *, cfg: TrainSpec) -> None:
        self.named = named
        self.opt = build_optimizer([p for _, p in named], cfg)

    def step(self, *, clip_coef: torch.Tensor | None) -> None:
        if clip_coef is not None:
            scale_grads_((p for _, p in self.named), clip_coef)
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def model_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(state[n])

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.opt.load_state_dict(sd)


class OffloadedOptimizer:
    """The rank's parameters become views into one flat low-precision device buffer (~2 bytes per
    parameter, plus its gradient); fp32 masters and both Adam moments stay in (pinned) host memory
    and stream through the device in buckets at each step."""

    offloaded = True

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        *,
        cfg: TrainSpec,
        offload: OffloadSpec,
        device: torch.device,
    ) -> None:
        from trainer.spill.ledger import DeviceLedger
        from trainer.spill.offload import DTYPES, OffloadedAdamW

        self.named = named
        self.dtype = DTYPES[offload.dtype]
        self.device = device
        self.views: list[slice] = []
        offset = 0
        for _, p in named:
            self.views.append(slice(offset, offset + p.numel()))
            offset += p.numel()
        pin = torch.cuda.is_available()
        master = torch.empty(offset, dtype=torch.float32, pin_memory=pin)
        for (_, p), sl in zip(named, self.views, strict=True):
            master[sl].copy_(p.detach().reshape(-1))
        self.master = master
        self.flat = master.to(device=device, dtype=self.dtype)
        with torch.no_grad():
            for (_, p), sl in zip(named, self.views, strict=True):
                p.data = self.flat[sl].view(p.shape)
        self.opt = OffloadedAdamW(
            masters=[master],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            dtype=self.dtype,
            device=device,
            bucket_numel=max(1024, min(4 * 2**20, offset // 128)),
            ledger=DeviceLedger(budget_bytes=None),
            copy_stream=torch.cuda.Stream(device) if device.type == "cuda" else None,
        )

    def step(self, *, clip_coef: torch.Tensor | None) -> None:
        grads = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in self.named]
        )
        # note: the offloaded update takes the coefficient as a number: a sync point when clipping
        coef = float(clip_coef.item()) if clip_coef is not None else 1.0
        self.opt.step_group(0, params=self.flat, grads=grads, clip_coef=coef)

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def model_state(self) -> dict[str, torch.Tensor]:
        """fp32 masters by name (the checkpoint holds full-precision weights)."""
        return {
            n: self.master[sl].view(p.shape).clone()
            for (n, p), sl in zip(self.named, self.views, strict=True)
        }

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        for (n, _), sl in zip(self.named, self.views, strict=True):
            self.master[sl].copy_(state[n].reshape(-1))
        self.opt.host_lp[0].copy_(self.master)
        self.flat.copy_(self.master)

    def state_dict(self) -> dict[str, Any]:
        names = [n for n, _ in self.named]
        return {"per_param": self.opt.state_by_name(0, names, self.views)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        names = [n for n, _ in self.named]
        self.opt.load_by_name(0, sd["per_param"], names, self.views)
