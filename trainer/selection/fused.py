"""Horizontal fusion (HFTA) of selection trials: K trials of one architecture trained as one model.

Trials of a search often differ only in their hyperparameters (lr, weight decay, momentum, seed,
gradient clipping). Their models then have the same shapes, so K of them can be packed into one
model whose every parameter has a leading member dim K, and one step trains all K: the forward is
the model's layers written over the member dim (K small matmuls become one batched matmul, K kernel
launches one), the K losses are summed for one backward (members share no parameter, so each
member's gradient is exactly its own loss's), and one optimizer step updates every member with its
own hyperparameters. Pure PyTorch, like the rest of trainer/.

What each member keeps from its run alone (tests/trainer/test_fused.py checks it to 1e-5):
  - its initial weights: each member's model is built by `build_dense` from its own seed, then
    copied into its slice of the stack;
  - its data: its own `BatchStream` (the trial's seed), batch k at its step k;
  - its loss: the recipe's loss of its own logits;
  - its step: AdamW or SGD (torch.optim's update rules, written over the stack) with its own lr,
    weight decay, momentum, bias correction (its own step count) and global-norm clip.

Layout: every member's parameters live in one row of a flat fp32 (K, N) buffer, and each parameter
of the stack is a view of its columns (K, *shape); gradients and optimizer state are (K, N) buffers
of the same layout. A per-member hyperparameter is then a (K, 1) tensor that broadcasts over the row,
and the whole optimizer step is a handful of elementwise ops over (K, N) whatever the number of
parameter tensors.

A member stopped early (ASHA) is dropped with `drop`, which repacks the others into K-1 rows
(weights, optimizer state and step counts carried over): the remaining members go on exactly as
before.

`fusable(jobs)` says which trials can share a stack and, for each trial left alone, why.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from jobrules.spec import JobSpec, ModelSpec, SpecError
from trainer.data import BatchStream, Dataset, data_for, with_data_vocab
from trainer.loop import check_finite, val_batches
from trainer.models import recipe_for
from trainer.optim import build_optimizer
from trainer.recipe import ModelRecipe, build_dense

FUSED_KINDS = ("gpt", "mlp")
"""Built-in models the batched layers below compute (trainer/models.py's GPT and MLP)."""

MATCH_FIELDS: tuple[tuple[str, str], ...] = (
    ("model", ""),
    ("data", ""),
    ("train", "batch_size"),
    ("train", "optimizer"),
    ("resources", "device"),
)
"""What members of one stack must share: the whole model and data specs (the architecture and the
data shape), the batch size and the optimizer type. Every other train field may differ."""

# the gradient of a parameter that is a strided view of the (K, N) buffer accumulates into its
# preset view in place (what the stack wants); torch warns that it is not the layout it would pick.
# Filtered for the process, not around each backward: catch_warnings is not thread-safe, and a
# batch's device threads step their stacks at once
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout")

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
"""torch.optim.AdamW's defaults, which trainer/optim.py's `build_optimizer` uses."""


# -- which trials fuse ---------------------------------------------------------------------------


def refusal(job: JobSpec) -> str | None:
    """Why `job` cannot be a member of any stack (None: it can)."""
    if job.model.kind not in FUSED_KINDS:
        return f"model.kind {job.model.kind!r}: only the built-in {' and '.join(FUSED_KINDS)} models fuse"
    if job.model.init_from is not None:
        return "model.init_from: a trial that starts from a weights file is not fused"
    if job.data.kind == "python":
        return "data.kind 'python': a user's data iterable carries state of its own per trial"
    par = job.parallel
    for name in ("spill", "offload", "pipeline", "tensor"):
        if getattr(par, name) is not None:
            return f"parallel.{name}: only single-device trials fuse"
    if par.data_parallel > 1:
        return f"parallel.data_parallel ({par.data_parallel}): only single-device trials fuse"
    return None


def difference(a: JobSpec, b: JobSpec) -> str | None:
    """The first field two trials must share and do not, with both values (None: they match)."""
    for section, name in MATCH_FIELDS:
        da, db = getattr(a, section).model_dump(), getattr(b, section).model_dump()
        keys = [name] if name else list(da)
        for k in keys:
            if da[k] != db[k]:
                return f"{section}.{k} differs ({da[k]!r} vs {db[k]!r})"
    return None


@dataclass(kw_only=True, slots=True, frozen=True)
class FuseGroup:
    members: tuple[int, ...]
    """Indices into the jobs given to `fusable`, in order."""
    reason: str | None = None
    """For a trial left alone: why it fuses with no other (None for a stack of two or more)."""

    @property
    def fused(self) -> bool:
        return len(self.members) > 1


def fusable(jobs: Sequence[JobSpec]) -> list[FuseGroup]:
    """Partition `jobs` into stacks: a trial joins the first stack whose first member it matches
    on every field of MATCH_FIELDS; a trial `refusal` names, or that matches no other, stands alone
    with the reason."""
    heads: list[int] = []
    members: dict[int, list[int]] = {}
    alone: dict[int, str] = {}
    for i, job in enumerate(jobs):
        why = refusal(job)
        if why is not None:
            alone[i] = why
            continue
        head = next((h for h in heads if difference(jobs[h], job) is None), None)
        if head is None:
            heads.append(i)
            members[i] = [i]
        else:
            members[head].append(i)
    groups: dict[int, FuseGroup] = {i: FuseGroup(members=(i,), reason=why) for i, why in alone.items()}
    for h in heads:
        if len(members[h]) > 1:
            groups[h] = FuseGroup(members=tuple(members[h]))
            continue
        others = [o for o in heads if o != h]
        why = difference(jobs[others[0]], jobs[h]) if others else "no other trial to fuse with"
        groups[h] = FuseGroup(members=(h,), reason=why)
    return [groups[i] for i in sorted(groups)]


def check_fusable(jobs: Sequence[JobSpec]) -> None:
    """Raise SpecError naming the field when `jobs` cannot all be members of one stack."""
    if not jobs:
        raise SpecError("a fused group needs at least one trial")
    for i, job in enumerate(jobs):
        why = refusal(job)
        if why is not None:
            raise SpecError(f"trial {i} cannot be fused: {why}")
        why = difference(jobs[0], job)
        if why is not None:
            raise SpecError(f"trial {i} cannot be fused with trial 0: {why}")


# -- batched layers: trainer/models.py's GPT and MLP over a leading member dim K -----------------
# Written out rather than vmapped: torch's vmap has no batching rule for CPU attention (it would loop
# over the members) and adds dispatch work to every op; here a Linear is one baddbmm over K, and
# attention folds K into the batch of one scaled_dot_product_attention call.


def _linear(x_KBTI: torch.Tensor, w_KOI: torch.Tensor, b_KO: torch.Tensor | None) -> torch.Tensor:
    K, B, T, In = x_KBTI.shape
    x_KRI = x_KBTI.reshape(K, B * T, In)
    if b_KO is None:
        y_KRO = torch.bmm(x_KRI, w_KOI.transpose(1, 2))
    else:
        y_KRO = torch.baddbmm(b_KO.unsqueeze(1), x_KRI, w_KOI.transpose(1, 2))
    return y_KRO.view(K, B, T, -1)


def _layer_norm(x_KBTD: torch.Tensor, w_KD: torch.Tensor, b_KD: torch.Tensor) -> torch.Tensor:
    y_KBTD = F.layer_norm(x_KBTD, x_KBTD.shape[-1:])
    return torch.addcmul(b_KD[:, None, None, :], y_KBTD, w_KD[:, None, None, :])


def _mlp(P: dict[str, torch.Tensor], pre: str, x_KBTD: torch.Tensor) -> torch.Tensor:
    h = F.gelu(_linear(x_KBTD, P[pre + "fc.weight"], P[pre + "fc.bias"]))
    return _linear(h, P[pre + "proj.weight"], P[pre + "proj.bias"])


def _attention(P: dict[str, torch.Tensor], pre: str, x_KBTD: torch.Tensor, *, heads: int) -> torch.Tensor:
    K, B, T, D = x_KBTD.shape
    q, k, v = _linear(x_KBTD, P[pre + "qkv.weight"], P[pre + "qkv.bias"]).split(D, dim=-1)
    # members are independent sequences to attention: fold K into the batch of one call
    q_NHTd, k_NHTd, v_NHTd = (t.reshape(K * B, T, heads, D // heads).transpose(1, 2) for t in (q, k, v))
    y_NHTd = F.scaled_dot_product_attention(q_NHTd, k_NHTd, v_NHTd, is_causal=True)
    y_KBTD = y_NHTd.transpose(1, 2).reshape(K, B, T, D)
    return _linear(y_KBTD, P[pre + "proj.weight"], P[pre + "proj.bias"])


def _embed(w_KVD: torch.Tensor, idx_KBT: torch.Tensor) -> torch.Tensor:
    K = w_KVD.shape[0]
    rows_K11 = torch.arange(K, device=idx_KBT.device).view(K, 1, 1)
    return w_KVD[rows_K11, idx_KBT]


def stacked_forward(cfg: ModelSpec, P: dict[str, torch.Tensor], idx_KBT: torch.Tensor) -> torch.Tensor:
    """logits_KBTV of K stacked members of the built-in `cfg.kind` model; P holds each parameter
    of the model's nn.Sequential by its name, with a leading K dim."""
    last = cfg.layers + 1
    x = _embed(P["0.tok.weight"], idx_KBT)
    if cfg.kind == "gpt":
        T = idx_KBT.shape[2]
        x = x + P["0.pos.weight"][:, None, :T, :]
        for i in range(1, last):
            pre = f"{i}."
            x = x + _attention(
                P, pre + "attn.", _layer_norm(x, P[pre + "ln1.weight"], P[pre + "ln1.bias"]), heads=cfg.heads
            )
            x = x + _mlp(P, pre + "mlp.", _layer_norm(x, P[pre + "ln2.weight"], P[pre + "ln2.bias"]))
    else:
        for i in range(1, last):
            pre = f"{i}."
            x = x + _mlp(P, pre + "mlp.", _layer_norm(x, P[pre + "ln.weight"], P[pre + "ln.bias"]))
    x = _layer_norm(x, P[f"{last}.ln.weight"], P[f"{last}.ln.bias"])
    return _linear(x, P[f"{last}.out.weight"], None)


def stacked_loss(logits_KBTV: torch.Tensor, targets_KBT: torch.Tensor) -> torch.Tensor:
    """Each member's mean next-token cross entropy (trainer/recipe.py's loss), shape (K,)."""
    K = logits_KBTV.shape[0]
    per_token = F.cross_entropy(logits_KBTV.flatten(0, -2).float(), targets_KBT.flatten(), reduction="none")
    return per_token.view(K, -1).mean(dim=1)


# -- the stack -----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class _Slot:
    name: str
    shape: torch.Size
    start: int
    stop: int


def _member_hparams(jobs: Sequence[JobSpec], *, device: torch.device) -> dict[str, torch.Tensor]:
    def col(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return {
        "lr": col([j.train.lr for j in jobs]),
        "weight_decay": col([j.train.weight_decay for j in jobs]),
        "momentum": col([j.train.momentum for j in jobs]),
        "grad_clip": col([j.train.grad_clip for j in jobs]),
    }


class FusedTrials:
    """K fusable trials as one stacked model on one device (see the module docstring)."""

    def __init__(
        self, jobs: Sequence[JobSpec], *, device: torch.device | str = "cpu", ids: Sequence[int] | None = None
    ) -> None:
        check_fusable(jobs)
        self.device = torch.device(device)
        self.jobs = [with_data_vocab(j) for j in jobs]
        self.ids = list(range(len(jobs))) if ids is None else list(ids)
        """Each row's member id: by default its index in the jobs this stack was built from (the
        caller's own keys with `ids`); dropping, taking or joining members keeps them."""
        if len(set(self.ids)) != len(self.jobs):
            raise ValueError(f"a stack needs one distinct id per job, got {self.ids} for {len(jobs)} jobs")
        first = self.jobs[0]
        self.recipe: ModelRecipe = recipe_for(first.model)
        self.optimizer = first.train.optimizer
        self.data: Dataset = data_for(first)
        # the data spec, seq_len and batch size are shared, so one dataset serves every member;
        # each member draws its own batches from it with its own seed
        self.streams = [
            BatchStream(data=self.data, batch_size=j.train.batch_size, seed=j.train.seed) for j in self.jobs
        ]
        models = [build_dense(self.recipe, seed=j.train.seed) for j in self.jobs]
        named = list(models[0].named_parameters())
        self.slots: list[_Slot] = []
        offset = 0
        for name, p in named:
            self.slots.append(_Slot(name=name, shape=p.shape, start=offset, stop=offset + p.numel()))
            offset += p.numel()
        self.n_params = offset
        """Parameters per member."""
        host = torch.empty(len(models), offset, dtype=torch.float32)
        for k, m in enumerate(models):
            host[k] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        del models
        state_keys = ["exp_avg", "exp_avg_sq"] if self.optimizer == "adamw" else ["momentum_buffer"]
        self._pack(
            flat=host.to(self.device),
            state={k: torch.zeros(len(self.jobs), offset, device=self.device) for k in state_keys},
            steps=torch.zeros(len(self.jobs), 1, dtype=torch.float64, device=self.device),
        )
        self.step_counts = [0] * len(self.jobs)
        """Optimizer steps each member has taken (its next batch is its stream's batch at this)."""

    # the stack's buffers and the views the forward reads; rebuilt whole when a member drops
    def _pack(self, *, flat: torch.Tensor, state: dict[str, torch.Tensor], steps: torch.Tensor) -> None:
        self.flat = flat
        self.grad = torch.zeros_like(flat)
        self.state = state
        self.steps = steps
        """Per-member AdamW step count, (K, 1) float64 on the device: the bias corrections read it
        there, so no step reads a number back to the host."""
        self.hp = _member_hparams(self.jobs, device=self.device)
        self.clips = any(j.train.grad_clip > 0 for j in self.jobs)
        self.params: dict[str, torch.Tensor] = {}
        K = flat.shape[0]
        for s in self.slots:
            p = flat[:, s.start : s.stop].view(K, *s.shape).detach().requires_grad_(True)
            # note: the gradient is preset to a view of self.grad, so autograd accumulates into the
            # flat buffer in place and the optimizer reads one (K, N) tensor
            p.grad = self.grad[:, s.start : s.stop].view(K, *s.shape)
            self.params[s.name] = p

    @property
    def size(self) -> int:
        """K: members in the stack now."""
        return len(self.jobs)

    def _logits(self, params: dict[str, torch.Tensor], x_KBT: torch.Tensor) -> torch.Tensor:
        return stacked_forward(self.jobs[0].model, params, x_KBT)

    def batches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of every member's next batch, stacked along a leading K dim."""
        pairs = [
            self.recipe.feed(s.batch_for(n)) for s, n in zip(self.streams, self.step_counts, strict=True)
        ]
        x = torch.stack([x for x, _ in pairs]).to(self.device)
        y = torch.stack([y for _, y in pairs]).to(self.device)
        return x, y

    def train_step(self, *, check: bool = True) -> list[float]:
        """One step of every member on its own next batch; returns each member's loss. `check`:
        raise TrainingError at a non-finite loss (False: the caller checks each member, as a
        batch does to fail that member alone; members share no parameter, so the others' steps
        are sound)."""
        x_K, y_K = self.batches()
        self.grad.zero_()
        loss_K = stacked_loss(self._logits(self.params, x_K), y_K)
        # members share no parameter: d(sum)/d(member k's weights) is member k's own gradient
        loss_K.sum().backward()
        # the optimizer reads self.grad: a gradient autograd put anywhere else would be lost
        assert all(p.grad is not None and p.grad._base is self.grad for p in self.params.values())
        self._step()
        losses = loss_K.detach().tolist()  # note: a CPU-GPU sync point, once per fused step
        for k in range(self.size):
            self.step_counts[k] += 1
        if check:
            for k in range(self.size):
                check_finite(losses[k], self.step_counts[k])
        return losses

    @torch.no_grad()
    def _clip(self) -> None:
        """Each member's global-norm clip (trainer/grads.py's coefficient); clip 0 leaves it be."""
        if not self.clips:
            return
        clip = self.hp["grad_clip"]
        norm = torch.linalg.vector_norm(self.grad, 2.0, dim=1, keepdim=True)
        coef = torch.where(clip > 0, torch.clamp(clip / (norm + 1e-6), max=1.0), torch.ones_like(norm))
        self.grad.mul_(coef)

    @torch.no_grad()
    def _step(self) -> None:
        self._clip()
        p, g, hp = self.flat, self.grad, self.hp
        if self.optimizer == "adamw":
            # torch.optim.AdamW (single-tensor rule), every member with its own lr, decay and step
            b1, b2 = ADAM_BETAS
            m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
            self.steps += 1
            bc1 = (1 - torch.pow(b1, self.steps)).float()
            bc2_sqrt = (1 - torch.pow(b2, self.steps)).sqrt().float()
            p.mul_(1 - hp["lr"] * hp["weight_decay"])
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / bc2_sqrt).add_(ADAM_EPS)
            p.addcdiv_(m * (hp["lr"] / bc1), denom, value=-1.0)
        else:
            # torch.optim.SGD: d = g + wd * p; buf = momentum * buf + d (a zero buffer makes the
            # first step's buf = d, torch's clone); p -= lr * buf
            buf = self.state["momentum_buffer"]
            d = g.add(p * hp["weight_decay"])
            buf.mul_(hp["momentum"]).add_(d)
            p.sub_(buf * hp["lr"])

    def drop(self, member: int) -> None:
        """Take the member whose job index is `member` out of the stack (ASHA stopped it); the
        others go on with their weights, optimizer state and step counts."""
        row = self.ids.index(member)
        keep = [k for k in range(self.size) if k != row]
        if not keep:
            raise ValueError("cannot drop the last member of a fused stack")
        self._members_of(self, keep)

    def to(self, device: torch.device) -> FusedTrials:
        """Move the stack's buffers to `device` (in place; nothing changes on the same device)."""
        device = torch.device(device)
        if device != self.device:
            self.device = device
            self._pack(
                flat=self.flat.to(device),
                state={k: v.to(device) for k, v in self.state.items()},
                steps=self.steps.to(device),
            )
        return self

    def take(self, member: int) -> FusedTrials:
        """Take the member whose id is `member` out of the stack as a stack of its own (its
        weights, optimizer state and step count carried over): it can wait apart (an ASHA rung)
        and `join` a stack again later; the others go on exactly as before."""
        row = self.ids.index(member)
        alone = self._rows([row])
        self.drop(member)
        return alone

    def join(self, other: FusedTrials) -> None:
        """Append `other`'s members (moved to this stack's device) as rows of this stack; each
        goes on from its own step with its own state. Both must be fusable (check_fusable)."""
        check_fusable([self.jobs[0], *other.jobs])
        if set(self.ids) & set(other.ids):
            raise ValueError(f"members {sorted(set(self.ids) & set(other.ids))} are already in the stack")
        for name in ("jobs", "ids", "streams", "step_counts"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        dev = self.device
        self._pack(
            flat=torch.cat([self.flat, other.flat.to(dev)]),
            state={k: torch.cat([v, other.state[k].to(dev)]) for k, v in self.state.items()},
            steps=torch.cat([self.steps, other.steps.to(dev)]),
        )

    def _rows(self, rows: list[int]) -> FusedTrials:
        """A new stack of these rows' members (copies of their buffers), sharing the dataset."""
        out = object.__new__(FusedTrials)
        out.device, out.recipe, out.optimizer, out.data = self.device, self.recipe, self.optimizer, self.data
        out.slots, out.n_params = self.slots, self.n_params
        out._members_of(self, rows)
        return out

    def _members_of(self, src: FusedTrials, rows: list[int]) -> None:
        """Make this stack's members `src`'s rows `rows`, in that order (copies of their buffers;
        `src` may be this stack)."""
        idx = torch.tensor(rows, device=src.device)
        for name in ("jobs", "ids", "streams", "step_counts"):
            values = getattr(src, name)
            setattr(self, name, [values[k] for k in rows])
        self._pack(
            flat=src.flat.index_select(0, idx),
            state={k: v.index_select(0, idx) for k, v in src.state.items()},
            steps=src.steps.index_select(0, idx),
        )

    def member_params(self, member: int) -> dict[str, torch.Tensor]:
        """The member's weights by the names its own `nn.Sequential` has, as CPU copies."""
        row = self.ids.index(member)
        return {n: p[row].detach().to("cpu", copy=True) for n, p in self.params.items()}

    def member_state(self, member: int) -> dict[str, Any]:
        """The member as the composed engine's checkpoint holds a single trial ("model" by name,
        "optimizer" in torch.optim's state_dict form, trainer/engine.py): `save_checkpoint` it and
        `trainer.runner.run` goes on from there alone, as if the trial had never been fused."""
        row = self.ids.index(member)
        job = self.jobs[row]
        model = self.member_params(member)
        named = [(n, torch.nn.Parameter(t)) for n, t in model.items()]
        opt = build_optimizer([p for _, p in named], job.train)
        steps = float(self.step_counts[row])
        for (_, p), s in zip(named, self.slots, strict=True):

            def rows(key: str, s: _Slot = s) -> torch.Tensor:
                return self.state[key][row, s.start : s.stop].view(s.shape).to("cpu", copy=True)

            if self.optimizer == "adamw":
                st = {
                    "step": torch.tensor(steps),
                    "exp_avg": rows("exp_avg"),
                    "exp_avg_sq": rows("exp_avg_sq"),
                }
            else:
                st = {"momentum_buffer": rows("momentum_buffer") if job.train.momentum > 0 else None}
            opt.state[p] = st
        return {"model": model, "optimizer": opt.state_dict()}

    def trial_state(self, member: int) -> dict[str, Any]:
        """The member as the selection executor's checkpoint holds a trial (ShardedTrial.state in
        trainer/selection/shards.py: "model" by name, "optimizer" {"per_param": {name: state}}),
        so a trial fused in one run resumes unfused in the next, and the other way round."""
        row = self.ids.index(member)
        job = self.jobs[row]
        if self.optimizer == "adamw":
            keys = ["exp_avg", "exp_avg_sq"]
        else:
            keys = ["momentum_buffer"] if job.train.momentum > 0 else []
        per_param: dict[str, dict[str, Any]] = {}
        for s in self.slots:
            st: dict[str, Any] = {
                k: self.state[k][row, s.start : s.stop].view(s.shape).to("cpu", copy=True) for k in keys
            }
            if self.optimizer == "adamw":
                st["step"] = float(self.step_counts[row])
            per_param[s.name] = st
        return {"model": self.member_params(member), "optimizer": {"per_param": per_param}}

    @torch.no_grad()
    def eval_losses(self, members: Sequence[int] | None = None) -> list[float]:
        """Each member's validation loss over its own fixed batches (trainer/loop.py's `evaluate`),
        of `members` (job indices; None: every member in the stack), in that order. One member at
        a time: evaluation is rare, and members may ask for different batch counts."""
        out = []
        rows = range(self.size) if members is None else [self.ids.index(m) for m in members]
        for row in rows:
            job = self.jobs[row]
            params = {n: p[row : row + 1] for n, p in self.params.items()}
            losses = [
                stacked_loss(self._logits(params, x.to(self.device)[None]), y.to(self.device)[None]).item()
                for x, y in val_batches(self.data, recipe=self.recipe, cfg=job.train)
            ]
            out.append(sum(losses) / len(losses))
        return out
