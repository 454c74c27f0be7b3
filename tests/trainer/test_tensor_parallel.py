"""Tensor-parallel layers, blocks and training runs against their dense versions, on real gloo ranks.

Spawning ranks is the slow part on a shared 2-core machine, so each world size is spawned once per
module (fixtures `ranks4`, `ranks8`) and runs every check for every mode of that size in turn; each
test below then asserts one check's outcome. Within a rank a mismatch is recorded, not raised, so
every rank keeps issuing the same collectives and a failure cannot hang the others.

  P=4: 1d (size 4) and 2d (q=2): every layer, the ledger of one linear, a 4-step training run.
  P=8: 1d (size 8) and 2.5d (q=2, d=2): every layer, the ledger of one linear; a 2.5d training run.

Layers checked (forward output, input gradient, every parameter shard's gradient, against the dense
layer built from the same weights): linear with and without bias, layer norm, attention, MLP,
embedding, head (vocabulary-split logits), a whole GPT block, and a one-block GPT with its
vocab-parallel loss. Then, on the same ranks: gradient clipping against clip_grad_norm_, and the
vocab-parallel cross entropy against F.cross_entropy.

Ledger derivation for one linear layer, fp32 (4 bytes), N = B*T rows, I inputs, O outputs:

1d, P ranks (Megatron).
  column-parallel: fwd nothing; bwd one all-reduce of dx_BTI, payload 4*N*I,
                   sent 2(P-1)/P * 4*N*I (ring). Its bias is split with the output: no traffic.
  row-parallel:    fwd one all-reduce of y_BTO, payload 4*N*O, sent 2(P-1)/P * 4*N*O; bwd nothing.
                   Its bias is added after the all-reduce on every rank: no traffic.
2d / 2.5d, q x q grid, depth d (2d is d = 1). Per rank: n = N/(d*q) rows,
  a = 4 * n * I/q   (an activation block),   w = 4 * (O/q) * (I/q)   (a weight block).
  fwd: q SUMMA steps, each one broadcast of a along the row and one of w down the column: 2q calls.
       A rank is root once per q steps in each group and a flat broadcast root sends (q-1) copies:
       sent (q-1)(a + w).
  bwd: q steps of [broadcast w, broadcast a, reduce dx partial (size a), reduce dW partial (size w)]:
       4q calls, sent (q-1)(a + w) for the broadcasts + (q-1)(a + w) for the reduces (a non-root
       sends its partial once per step, the root nothing); then, if d > 1, one all-reduce of w over
       depth: sent 2(d-1)/d * w.
  bias (O/q values, payload b = 4*O/q): bwd all-reduce over the column (sent 2(q-1)/q * b) and, if
       d > 1, over depth (2(d-1)/d * b).
  Total sent: 3(q-1)(a + w) + 2(d-1)/d * w [+ bias terms]; with a = S/(d q^2), w = S/q^2 for S = N*I
  = I*O this is 3(q-1)(d+1)/(d q) * S/q (+ the depth all-reduce), the Tesseract paper's bandwidth
  cost in units of S/q.
"""

from __future__ import annotations

import traceback
from collections import defaultdict
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from jobrules.spec import DataSpec, JobSpec, ModelSpec, ParallelSpec, TensorSpec, TrainSpec
from tests.gloo import run_ranks
from tests.trainer.stops import StopAfter
from trainer.models import Block, build_model, lm_loss
from trainer.protocol import ListSink, NeverStop
from trainer.runner import run
from trainer.tensor import comm, layers_1d, layers_25d
from trainer.tensor.block import (
    clip_grad_norm,
    global_loss,
    local_batch,
    loss_fn,
    shard_block,
    shard_model,
    slicers,
)
from trainer.tensor.cross_entropy import VocabParallelLoss, vocab_parallel_cross_entropy
from trainer.tensor.grid import Grid1D, TesseractGrid, tensor_grid_for

B, T, D, H = 4, 8, 32, 8
N_IN, N_OUT = 32, 48
LAYERS = [
    "linear+bias",
    "linear",
    "layernorm",
    "attention",
    "mlp",
    "embedding",
    "head",
    "head-gathered",
    "block",
    "gpt",
]

TP_1D_4 = TensorSpec(mode="1d", size=4)
TP_2D = TensorSpec(mode="2d", q=2)
TP_1D_8 = TensorSpec(mode="1d", size=8)
TP_25D = TensorSpec(mode="2.5d", q=2, d=2)


def linear_ledger_1d(*, kind: str, P: int, N: int, n_in: int, n_out: int) -> dict[str, tuple[int, Fraction]]:
    """(calls, sent bytes) per phase for one 1d linear, by the derivation in the module docstring."""
    if kind == "column":
        return {"fwd": (0, Fraction(0)), "bwd": (1, Fraction(2 * (P - 1) * 4 * N * n_in, P))}
    return {"fwd": (1, Fraction(2 * (P - 1) * 4 * N * n_out, P)), "bwd": (0, Fraction(0))}


def linear_ledger_grid(
    *, q: int, d: int, N: int, n_in: int, n_out: int, bias: bool
) -> dict[str, tuple[int, Fraction]]:
    n = N // (d * q)
    a, w, b = 4 * n * n_in // q, 4 * (n_out // q) * (n_in // q), 4 * n_out // q
    fwd = (2 * q, Fraction((q - 1) * (a + w)))
    calls = 4 * q + (d > 1)
    sent = Fraction(2 * (q - 1) * (a + w)) + Fraction(2 * (d - 1) * w, d)
    if bias:
        calls += 1 + (d > 1)
        sent += Fraction(2 * (q - 1) * b, q) + Fraction(2 * (d - 1) * b, d)
    return {"fwd": fwd, "bwd": (calls, sent)}


# ---- inside the ranks --------------------------------------------------------------------------


class Checks:
    """Records mismatches instead of raising, so all ranks run the same collectives to the end."""

    def __init__(self) -> None:
        self.failures: dict[str, list[str]] = defaultdict(list)
        self.done: list[str] = []

    def close(self, label: str, actual: Any, expected: Any, what: str) -> None:
        try:
            assert_close(actual, expected)
        except AssertionError as e:
            self.failures[label].append(f"{what}: {e}"[:600])


def _ledger_phases(layer: str) -> dict[str, tuple[int, Fraction]]:
    out = {}
    for ph in ("fwd", "bwd"):
        c = comm.LEDGER.total(layer=layer, phase=ph)
        out[ph] = (c.calls, c.sent)
    return out


def _compare(
    checks: Checks,
    label: str,
    *,
    dense: nn.Module,
    tp: nn.Module,
    x: torch.Tensor,
    x_local: torch.Tensor,
    out_shard: Callable[[torch.Tensor], torch.Tensor],
    in_shard: Callable[[torch.Tensor], torch.Tensor] | None,
) -> None:
    """Forward both, backward the same random weighting of the outputs, compare everything."""
    dense.zero_grad()
    float_input = in_shard is not None
    x = x.clone().requires_grad_(float_input)
    y = dense(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * g).sum().backward()

    x_local = x_local.detach().clone().requires_grad_(float_input)
    y_local = tp(x_local)
    checks.close(label, y_local, out_shard(y.detach()), "output")
    # each rank's share of sum(y * g): disjoint blocks add up to it, replicated copies each equal it
    (y_local * out_shard(g)).sum().backward()
    if in_shard is not None:
        checks.close(label, x_local.grad, in_shard(x.grad), "input grad")
    dense_params = dict(dense.named_parameters())
    local_params = dict(tp.named_parameters())
    for name, fn in slicers(tp).items():
        checks.close(label, local_params[name].grad, fn(dense_params[name].grad), f"{name} grad")
    checks.done.append(label)


def _layers_task(tensor: TensorSpec) -> dict[str, Any]:
    checks = Checks()
    grid = tensor_grid_for(tensor)
    gpt = build_model(ModelSpec(layers=1, d_model=D, heads=H, seq_len=T, mlp_ratio=2), seed=1)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, 128, (B, T + 1), generator=torch.Generator().manual_seed(4))
    x_in = torch.randn(B, T, N_IN, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    linears = {"linear+bias": nn.Linear(N_IN, N_OUT), "linear": nn.Linear(N_IN, N_OUT, bias=False)}
    ledgers: dict[str, dict] = {}

    if isinstance(grid, Grid1D):

        def cols(t: torch.Tensor) -> torch.Tensor:
            return layers_1d.block_of(t, dim=-1, index=grid.rank, parts=grid.size)

        def x_shard(t: torch.Tensor) -> torch.Tensor:
            return t

        rows = x_shard
        vocab = cols  # the head's output: all rows, this rank's vocabulary block
        for label, lin in linears.items():
            comm.LEDGER.reset()
            col = layers_1d.ColumnLinear(lin, grid=grid, name=f"col.{label}")
            _compare(checks, label, dense=lin, tp=col, x=x_in, x_local=x_in, out_shard=cols, in_shard=x_shard)
            row = layers_1d.RowLinear(lin, grid=grid, name=f"row.{label}")
            _compare(
                checks, label, dense=lin, tp=row, x=x_in, x_local=cols(x_in), out_shard=x_shard, in_shard=cols
            )
            ledgers[f"col.{label}"] = _ledger_phases(f"col.{label}")
            ledgers[f"row.{label}"] = _ledger_phases(f"row.{label}")
    else:
        assert isinstance(grid, TesseractGrid)

        def x_shard(t: torch.Tensor) -> torch.Tensor:
            return layers_25d.cols_of(layers_25d.rows_of(t, grid), grid)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return layers_25d.rows_of(t, grid)

        vocab = x_shard  # the head's output: this rank's rows, its vocabulary block j

        for label, lin in linears.items():
            comm.LEDGER.reset()
            tp = layers_25d.LinearGrid(lin, grid=grid, name=f"lin.{label}")
            _compare(
                checks,
                label,
                dense=lin,
                tp=tp,
                x=x_in,
                x_local=x_shard(x_in),
                out_shard=x_shard,
                in_shard=x_shard,
            )
            ledgers[f"lin.{label}"] = _ledger_phases(f"lin.{label}")

    block_ledger = _check_block(checks, gpt[1], grid=grid, x=x, x_shard=x_shard)

    tp_model = shard_model(gpt, grid=grid)
    idx, targets = ids[:, :-1], ids[:, 1:]
    _check_ends(
        checks, gpt=gpt, tp_model=tp_model, grid=grid, idx=idx, x=x, rows=rows, x_shard=x_shard, vocab=vocab
    )
    _check_gpt_loss(checks, gpt=gpt, tp_model=tp_model, idx=idx, targets=targets, grid=grid)
    _check_clip(checks, dense=gpt, tp=tp_model, grid=grid)
    ce_ledger = _check_cross_entropy(checks, grid=grid, rows=rows, vocab=vocab)
    return {
        "failures": dict(checks.failures),
        "done": checks.done,
        "ledgers": ledgers,
        "block": block_ledger,
        "ce": ce_ledger,
    }


def _check_ends(
    checks: Checks,
    *,
    gpt: nn.Sequential,
    tp_model: nn.Sequential,
    grid: Grid1D | TesseractGrid,
    idx: torch.Tensor,
    x: torch.Tensor,
    rows: Callable[[torch.Tensor], torch.Tensor],
    x_shard: Callable[[torch.Tensor], torch.Tensor],
    vocab: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Embedding: integer input, no input gradient; head: this rank's vocabulary block of its rows."""
    # gather_logits=True: whole rows of logits (every vocabulary block) for this rank's rows
    gathered = shard_model(gpt, grid=grid, gather_logits=True)
    # label, dense layer, its shard, input, this rank's input, shard of the output, of the input
    for label, dense, tp, inp, local, out_s, in_s in (
        ("embedding", gpt[0], tp_model[0], idx, rows(idx), x_shard, None),
        ("head", gpt[2], tp_model[2], x, x_shard(x), vocab, x_shard),
        ("head-gathered", gpt[2], gathered[2], x, x_shard(x), rows, x_shard),
    ):
        _compare(checks, label, dense=dense, tp=tp, x=inp, x_local=local, out_shard=out_s, in_shard=in_s)


def _check_block(
    checks: Checks,
    block: Block,
    *,
    grid: Grid1D | TesseractGrid,
    x: torch.Tensor,
    x_shard: Callable[[torch.Tensor], torch.Tensor],
) -> dict[tuple[str, str], tuple[int, int, Fraction]]:
    """A transformer block and each of its parts against their sharded forms; the block's
    collectives (calls, payload, bytes sent) per (layer, phase)."""
    for label, pick in (("layernorm", "ln1"), ("attention", "attn"), ("mlp", "mlp"), ("block", None)):
        tp_block = shard_block(block, grid=grid, name="blk")
        dense = block if pick is None else getattr(block, pick)
        tp = tp_block if pick is None else getattr(tp_block, pick)
        comm.LEDGER.reset()
        _compare(
            checks, label, dense=dense, tp=tp, x=x, x_local=x_shard(x), out_shard=x_shard, in_shard=x_shard
        )
    block_ledger: dict[tuple[str, str], tuple[int, int, Fraction]] = {}
    for (layer, phase, _), c in comm.LEDGER.records.items():
        calls, payload, sent = block_ledger.get((layer, phase), (0, 0, Fraction(0)))
        block_ledger[(layer, phase)] = (calls + c.calls, payload + c.payload, sent + c.sent)
    return block_ledger


def _check_gpt_loss(
    checks: Checks,
    *,
    gpt: nn.Sequential,
    tp_model: nn.Sequential,
    idx: torch.Tensor,
    targets: torch.Tensor,
    grid: Grid1D | TesseractGrid,
) -> None:
    """One-block GPT and its loss: the local loss terms' gradients are the dense loss's, and the
    forward gathers nothing."""
    gpt.zero_grad()
    tp_model.zero_grad()
    dense_loss = lm_loss(gpt(idx), targets)
    dense_loss.backward()
    comm.LEDGER.reset()
    local = loss_fn(
        tp_model(local_batch(idx, grid=grid)), local_batch(targets, grid=grid), grid=grid, global_rows=B
    )
    gathers = [key for key in comm.LEDGER.records if key[2] == "all_gather"]
    if gathers:
        checks.failures["gpt"].append(f"the forward gathered: {gathers}")
    local.backward()
    checks.close("gpt", torch.tensor(global_loss(local, grid=grid)), dense_loss.detach(), "loss")
    dense_params = dict(gpt.named_parameters())
    cut = slicers(tp_model)
    for name, p in tp_model.named_parameters():
        checks.close("gpt", p.grad, cut[name](dense_params[name].grad), f"{name} grad")
    checks.done.append("gpt")


def _check_clip(checks: Checks, *, dense: nn.Module, tp: nn.Module, grid: Grid1D | TesseractGrid) -> None:
    """Both models hold the same (sharded) gradients: clip both, compare the norm and every shard.
    A replicated parameter counted on more than one rank, or a sum over too few ranks, changes the
    norm and so the clipped gradients."""
    max_norm = 0.05
    # first without `tp_counted` (a layer that marks only `tp_replicas`: each copy weighs
    # 1/replicas) and max_norm = inf, which leaves the gradients as they are
    unclipped = torch.nn.utils.clip_grad_norm_(dense.parameters(), float("inf"))
    marks = {name: p.__dict__.pop("tp_counted") for name, p in tp.named_parameters()}
    checks.close(
        "clip",
        clip_grad_norm(tp.parameters(), max_norm=float("inf"), grid=grid),
        unclipped,
        "norm by 1/replicas",
    )
    for name, p in tp.named_parameters():
        p.tp_counted = marks[name]  # type: ignore[attr-defined]
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
    if not dense_norm > 4 * max_norm:
        checks.failures["clip"].append(f"dense norm {dense_norm} too small to clip: the check proves nothing")
    norm = clip_grad_norm(tp.parameters(), max_norm=max_norm, grid=grid)
    checks.close("clip", norm, dense_norm, "norm")
    grad = next(p.grad for p in tp.parameters() if p.grad is not None)
    if norm.device != grad.device or norm.dim() != 0:
        checks.failures["clip"].append(f"norm is {norm.shape} on {norm.device}, gradients on {grad.device}")
    dense_params = dict(dense.named_parameters())
    cut = slicers(tp)
    for name, p in tp.named_parameters():
        checks.close("clip", p.grad, cut[name](dense_params[name].grad), f"{name} clipped grad")
    checks.done.append("clip")

    # the same function on meta-device gradients, over a one-rank grid: any read-back to the host
    # (.item(), .cpu(), float(t)) or a tensor made on the host would raise here; on NCCL that is
    # what would otherwise sync the step or put a CPU tensor into the collective
    solo, _ = dist.new_subgroups(group_size=1)
    meta = [nn.Parameter(torch.empty(6, 4, device="meta")) for _ in range(3)]
    for k, p in enumerate(meta):
        p.grad = torch.empty(6, 4, device="meta")
        p.tp_replicas = 2  # type: ignore[attr-defined]
        if k != 2:  # the third weighs 1/replicas
            p.tp_counted = k != 1  # type: ignore[attr-defined]
    try:
        norm = clip_grad_norm(meta, max_norm=1.0, grid=Grid1D(group=solo, size=1, rank=0))
        if norm.device.type != "meta":
            checks.failures["clip"].append(f"meta gradients gave a norm on {norm.device}")
    except Exception as e:  # noqa: BLE001 - recorded, so every rank goes on to the same collectives
        checks.failures["clip"].append(f"clip_grad_norm left the gradients' device: {e!r}"[:600])


def _check_cross_entropy(
    checks: Checks,
    *,
    grid: Grid1D | TesseractGrid,
    rows: Callable[[torch.Tensor], torch.Tensor],
    vocab: Callable[[torch.Tensor], torch.Tensor],
) -> dict[tuple[str, str], tuple[int, int]]:
    """Vocab-parallel cross entropy of this rank's logits block against F.cross_entropy of the whole
    logits: per-token values, the mean loss and the logits' gradient. Large logits, so a missing
    max subtraction overflows exp(). Returns the ledger of the loss: (calls, payload) per op."""
    V = 128
    logits = (torch.randn(B, T, V, generator=torch.Generator().manual_seed(8)) * 30).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(9))
    dense = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    dense.backward()
    per_token = F.cross_entropy(logits.detach().flatten(0, 1), targets.flatten(), reduction="none").view(B, T)

    local_logits = vocab(logits.detach()).clone().requires_grad_()
    comm.LEDGER.reset()
    local = loss_fn(local_logits, rows(targets), grid=grid, global_rows=B)
    ledger = {(layer, op): (c.calls, c.payload) for (layer, _, op), c in comm.LEDGER.records.items()}
    local.backward()
    checks.close("cross-entropy", torch.tensor(global_loss(local, grid=grid)), dense.detach(), "loss")
    checks.close("cross-entropy", local_logits.grad, vocab(logits.grad), "logits grad")
    with comm.paused():
        mine = vocab_parallel_cross_entropy(vocab(logits.detach()), rows(targets), grid=grid)
    checks.close("cross-entropy", mine, rows(per_token), "per-token loss")
    checks.done.append("cross-entropy")
    return ledger


def _job(tensor: TensorSpec | None) -> JobSpec:
    # grad_clip is small enough to clip every step: the sharded global norm must match the dense one
    return JobSpec(
        model=ModelSpec(layers=2, d_model=32, heads=4, seq_len=16, mlp_ratio=2),
        data=DataSpec(max_chars=20_000),
        train=TrainSpec(steps=4, batch_size=4, lr=1e-2, seed=3, eval_every=2, eval_batches=2, grad_clip=0.5),
        parallel=ParallelSpec(tensor=tensor),
    )


def _train_task(tensor: TensorSpec) -> dict[str, Any]:
    from trainer.runner import run

    sink = ListSink()
    result = run(_job(tensor), sink=sink, stop=NeverStop(), checkpoint_dir=None)
    return {
        "loss": sink.series("loss"),
        "val_loss": sink.series("val_loss"),
        "comm": dict(sink.events).get("comm"),
        "result": result,
    }


def _resume_task(tensor: TensorSpec, checkpoint_dir: str | None = None) -> dict[str, Any]:
    """Stopped after 2 of 4 steps, then resumed from the per-rank checkpoints."""
    from pathlib import Path

    from trainer.runner import run

    assert checkpoint_dir is not None
    first, second = ListSink(), ListSink()
    r1 = run(_job(tensor), sink=first, stop=StopAfter(2), checkpoint_dir=Path(checkpoint_dir))
    r2 = run(_job(tensor), sink=second, stop=NeverStop(), checkpoint_dir=Path(checkpoint_dir))
    return {
        "first": {"loss": first.series("loss"), "stopped": r1["stopped"], "steps": r1["steps"]},
        "second": {"loss": second.series("loss"), "steps": r2["steps"], "logs": second.logs},
    }


def _pipeline_1d_task(tensor: TensorSpec) -> dict[str, Any]:
    """2 pipeline stages x 2-way 1d on 4 ranks, rank = stage*2 + tp: trainer/pipeline's driver runs
    1F1B over 2 micro-batches, each stage's layers are 1d-sharded over its 2 ranks, the last stage's
    loss is the vocab-parallel cross entropy of its vocabulary-split logits. Two optimizer steps
    with clipping; the losses, every shard's gradient, the global norm (summed over the tensor grid
    and the pipeline group) and every clipped shard must equal the dense full-batch ones."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.optim import build_optimizer
    from trainer.pipeline.driver import PipelineDriver
    from trainer.pipeline.schedules import build_schedule
    from trainer.pipeline.stage import build_stages, stage_bounds
    from trainer.tensor.grid import tensor_grid

    checks = Checks()
    dm = init_device_mesh("cpu", (2, tensor.size), mesh_dim_names=("pp", "tp"))
    stage = dm.get_local_rank("pp")
    tp = tensor_grid(dm["tp"])
    pipe_ranks = dist.get_process_group_ranks(dm.get_group("pp"))
    job = _job(TensorSpec(mode="1d", size=tensor.size))
    cfg, n_micro = job.train, 2
    dense = build_model(job.model, seed=cfg.seed)
    sched = build_schedule("1f1b", stages=2, microbatches=n_micro)
    lo, _ = stage_bounds(dense, 2)[stage]
    (dense_stage,) = build_stages(build_model(job.model, seed=cfg.seed), sched=sched, rank=stage).values()
    sharded = shard_model(dense_stage, grid=tp, first_index=lo)
    driver = PipelineDriver(
        sched=sched,
        rank=stage,
        modules={(stage, 0): sharded},
        act_shape=(cfg.batch_size // n_micro, job.model.seq_len, job.model.d_model),
        ranks=pipe_ranks,
        loss_fn=VocabParallelLoss(tp),
    )
    opt = build_optimizer(sharded.parameters(), cfg)
    dense_opt = build_optimizer(dense.parameters(), cfg)
    gen = torch.Generator().manual_seed(11)
    losses = []
    try:
        for step in range(2):
            idx = torch.randint(0, 128, (cfg.batch_size, job.model.seq_len + 1), generator=gen)
            x, y = idx[:, :-1], idx[:, 1:]
            dense_opt.zero_grad()
            dense_loss = lm_loss(dense(x), y)
            dense_loss.backward()
            opt.zero_grad()
            record = driver.step(x, y)
            if stage == 1:
                # fp32 losses (a Python float would get float64 tolerances)
                checks.close("pipeline", torch.tensor(record.loss), dense_loss.detach(), f"step {step} loss")
                losses.append(record.loss)
            dense_params = dict(dense.named_parameters())
            cut = slicers(sharded)
            for name, p in sharded.named_parameters():
                index, rest = name.split(".", 1)
                want = cut[name](dense_params[f"{lo + int(index)}.{rest}"].grad)
                checks.close("pipeline", p.grad, want, f"step {step} {lo + int(index)}.{rest} grad")
            # clip both: this stage's shards sum over the tensor grid and then the pipeline group
            dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05)
            norm = clip_grad_norm(
                sharded.parameters(), max_norm=0.05, grid=tp, also_over=(dm.get_group("pp"),)
            )
            checks.close("pipeline", norm, dense_norm, f"step {step} clip norm")
            for name, p in sharded.named_parameters():
                index, rest = name.split(".", 1)
                want = cut[name](dense_params[f"{lo + int(index)}.{rest}"].grad)
                checks.close("pipeline", p.grad, want, f"step {step} {lo + int(index)}.{rest} clipped grad")
            opt.step()
            dense_opt.step()
    finally:
        driver.close()
    checks.done.append("pipeline")
    return {"failures": dict(checks.failures), "done": checks.done, "losses": losses, "stage": stage}


TASKS: dict[str, Callable[..., dict[str, Any]]] = {
    "layers": _layers_task,
    "train": _train_task,
    "resume": _resume_task,
    "pipeline-1d": _pipeline_1d_task,
}


def _run_tasks(
    rank: int, world_size: int, tasks: list[tuple[str, str, TensorSpec]], checkpoint_dir: str | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, kind, tensor in tasks:
        try:
            extra = {"checkpoint_dir": checkpoint_dir} if kind == "resume" else {}
            out[key] = ("ok", TASKS[kind](tensor, **extra))
        except Exception:  # noqa: BLE001 - reported by the test that reads this key
            out[key] = ("error", traceback.format_exc())
            break  # the other ranks may now be inside a collective this rank will never join
    return out


# ---- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tasks = [
        ("1d-P4", "layers", TP_1D_4),
        ("2d-P4", "layers", TP_2D),
        ("train-1d", "train", TP_1D_4),
        ("train-2d", "train", TP_2D),
        ("resume-2d", "resume", TP_2D),
        # last: it builds a (pp, tp) grid of its own
        ("pipeline-2x1d2", "pipeline-1d", TensorSpec(mode="1d", size=2)),
    ]
    ckpt = str(tmp_path_factory.mktemp("tp-ckpt"))
    return run_ranks(_run_tasks, world_size=4, args=(tasks, ckpt), timeout_s=300)


@pytest.fixture(scope="module")
def ranks8() -> list[dict[str, Any]]:
    tasks = [("1d-P8", "layers", TP_1D_8), ("2.5d-P8", "layers", TP_25D), ("train-2.5d", "train", TP_25D)]
    return run_ranks(_run_tasks, world_size=8, args=(tasks,), timeout_s=300)


@pytest.fixture(scope="module")
def dense_losses() -> ListSink:
    ref = ListSink()
    run(_job(None), sink=ref, stop=NeverStop(), checkpoint_dir=None)
    return ref


def _task(results: list[dict[str, Any]], key: str) -> list[Any]:
    values = []
    for rank, out in enumerate(results):
        status, value = out.get(key, ("error", "task never ran (an earlier task failed)"))
        assert status == "ok", f"rank {rank}, {key}:\n{value}"
        values.append(value)
    return values


MODES = [("1d-P4", "ranks4"), ("2d-P4", "ranks4"), ("1d-P8", "ranks8"), ("2.5d-P8", "ranks8")]


@pytest.mark.slow
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize(("key", "fixture"), MODES, ids=[k for k, _ in MODES])
def test_layer_matches_dense(key: str, fixture: str, layer: str, request: pytest.FixtureRequest) -> None:
    for rank, value in enumerate(_task(request.getfixturevalue(fixture), key)):
        assert layer in value["done"], f"rank {rank}: {layer} not checked"
        assert layer not in value["failures"], f"rank {rank}: " + "\n".join(value["failures"][layer])


@pytest.mark.slow
@pytest.mark.parametrize(("key", "fixture"), MODES, ids=[k for k, _ in MODES])
def test_clip_grad_norm_matches_dense(key: str, fixture: str, request: pytest.FixtureRequest) -> None:
    """block.clip_grad_norm of the sharded one-block GPT's gradients equals
    torch.nn.utils.clip_grad_norm_ of the dense GPT's (the norm and every clipped shard), with a
    max_norm small enough that it clips. The replicated parameters (1d: layer norms, row-parallel
    biases, position table; grid: weight blocks repeated over depth, vectors repeated over rows and
    depth) must each be counted once and the sum must cover the whole tensor grid, or the norm moves.

    What this proves for NCCL: the sum of squares is all-reduced over the tensor grid's own groups
    (never WORLD; trainer.grads.grad_norm), the same calls NCCL would run. That it stays on the device is
    proved separately on meta-device gradients (a host read-back or a host tensor raises there); gloo
    itself would accept a CPU tensor, so the gloo run cannot show it."""
    for rank, value in enumerate(_task(request.getfixturevalue(fixture), key)):
        assert "clip" in value["done"], f"rank {rank}: clip not checked"
        assert "clip" not in value["failures"], f"rank {rank}: " + "\n".join(value["failures"]["clip"])


@pytest.mark.slow
@pytest.mark.parametrize(("key", "fixture"), MODES, ids=[k for k, _ in MODES])
def test_vocab_parallel_cross_entropy_matches_dense(
    key: str, fixture: str, request: pytest.FixtureRequest
) -> None:
    """Each rank holds only its vocabulary block of its rows' logits (1d: V/P columns of every row;
    grid: V/q columns of its B/(dq) rows). The loss, the per-token losses and the logits' gradient
    equal F.cross_entropy on the whole logits. What travels is two all-reduces over the ranks that
    share the rows (the row max, then sum-exp with the target logit): 3 floats per row, never an
    all-gather; the whole GPT's forward (previous check, "gpt") issues no all-gather either.

    What this proves for NCCL: the collectives and their groups; their operands are derived from the
    logits (on the device under NCCL), and backward issues none."""
    tensor = {"1d-P4": TP_1D_4, "2d-P4": TP_2D, "1d-P8": TP_1D_8, "2.5d-P8": TP_25D}[key]
    rows = B * T if tensor.mode == "1d" else B // (tensor.d * tensor.q) * T
    for rank, value in enumerate(_task(request.getfixturevalue(fixture), key)):
        assert "cross-entropy" in value["done"], f"rank {rank}: cross-entropy not checked"
        failures = value["failures"].get("cross-entropy", [])
        assert not failures, f"rank {rank}: " + "\n".join(failures)
        assert value["ce"] == {("ce", "all_reduce"): (2, 4 * rows + 8 * rows)}, f"rank {rank}: {value['ce']}"


@pytest.mark.slow
@pytest.mark.parametrize(("key", "fixture"), MODES, ids=[k for k, _ in MODES])
def test_linear_ledger_equals_derivation(key: str, fixture: str, request: pytest.FixtureRequest) -> None:
    tensor = {"1d-P4": TP_1D_4, "2d-P4": TP_2D, "1d-P8": TP_1D_8, "2.5d-P8": TP_25D}[key]
    N = B * T
    for value in _task(request.getfixturevalue(fixture), key):
        ledgers = value["ledgers"]
        for label, bias in (("linear+bias", True), ("linear", False)):
            if tensor.mode == "1d":
                for kind, tag in (("column", "col"), ("row", "row")):
                    want = linear_ledger_1d(kind=kind, P=tensor.size, N=N, n_in=N_IN, n_out=N_OUT)
                    assert ledgers[f"{tag}.{label}"] == want, (tag, label)
            else:
                want = linear_ledger_grid(q=tensor.q, d=tensor.d, N=N, n_in=N_IN, n_out=N_OUT, bias=bias)
                assert ledgers[f"lin.{label}"] == want, label


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "fixture", "world"),
    [("train-1d", "ranks4", 4), ("train-2d", "ranks4", 4), ("train-2.5d", "ranks8", 8)],
)
def test_training_matches_dense(
    key: str, fixture: str, world: int, dense_losses: ListSink, request: pytest.FixtureRequest
) -> None:
    out = _task(request.getfixturevalue(fixture), key)
    rank0 = out[0]
    assert len(rank0["loss"]) == 4
    assert_close(rank0["loss"], dense_losses.series("loss"), rtol=1e-5, atol=1e-5)
    assert_close(rank0["val_loss"], dense_losses.series("val_loss"), rtol=1e-5, atol=1e-5)
    for r in out:  # every rank computed the same global loss; only rank 0 emitted metrics
        assert_close(r["result"]["final_loss"], rank0["result"]["final_loss"])
    assert all(r["loss"] == [] for r in out[1:])
    summary = rank0["comm"]
    assert summary["steps"] == 4 and len(summary["per_rank"]) == world
    assert all(row["total"]["calls"] > 0 for row in summary["per_rank"])


@pytest.mark.slow
def test_stop_and_resume_from_per_rank_checkpoints(
    ranks4: list[dict[str, Any]], dense_losses: ListSink
) -> None:
    out = _task(ranks4, "resume-2d")
    for value in out:  # every rank left at the same step, because should_stop sums every rank's answer
        assert value["first"]["stopped"] and value["first"]["steps"] == 2
        assert value["second"]["steps"] == 4
    rank0 = out[0]
    assert any("resumed from" in line for line in rank0["second"]["logs"])
    assert_close(
        rank0["first"]["loss"] + rank0["second"]["loss"], dense_losses.series("loss"), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_two_pipeline_stages_of_2way_1d_match_dense(ranks4: list[dict[str, Any]]) -> None:
    """pp = 2 x tp(1d) = 2: losses, gradients, the clipping norm and the clipped gradients against
    the dense model (see _pipeline_1d_task). What this proves for NCCL: the loss and the clipping
    issue their collectives on the tensor group and the pipeline group only, in the same order on
    every rank; the pipeline's own point-to-point traffic is the driver's (tests of its own)."""
    out = _task(ranks4, "pipeline-2x1d2")
    for rank, value in enumerate(out):
        assert value["done"] == ["pipeline"], f"rank {rank}"
        assert not value["failures"], f"rank {rank}: " + "\n".join(value["failures"]["pipeline"])
    assert [v["stage"] for v in out] == [0, 0, 1, 1]
    assert all(len(v["losses"]) == 2 for v in out[2:])


@pytest.mark.slow
@pytest.mark.parametrize(("key", "fixture"), MODES, ids=[k for k, _ in MODES])
def test_block_ledger_equals_accounting(key: str, fixture: str, request: pytest.FixtureRequest) -> None:
    """The whole block's ledger, sub-layer by sub-layer, equals trainer/tensor/accounting.py (the
    derivation bench/tensor.py and docs/tensor.md use for sizes that are not spawned)."""
    from trainer.tensor.accounting import BlockShape, block_costs

    tensor = {"1d-P4": TP_1D_4, "2d-P4": TP_2D, "1d-P8": TP_1D_8, "2.5d-P8": TP_25D}[key]
    want = block_costs(
        tensor.mode, shape=BlockShape(N=B * T, D=D, F=2 * D), P=tensor.size, q=tensor.q, d=tensor.d
    )
    for rank, value in enumerate(_task(request.getfixturevalue(fixture), key)):
        got = value["block"]
        assert {layer for layer, _ in got} <= {f"blk.{sub}" for sub in want}, f"rank {rank}: {sorted(got)}"
        for sub, cost in want.items():
            for phase in ("fwd", "bwd"):
                c = getattr(cost, phase)
                measured = got.get((f"blk.{sub}", phase), (0, 0, Fraction(0)))
                assert measured == (c.calls, c.payload, c.sent), (rank, sub, phase)
