"""Tensor-parallel layers against the dense layers they were cut from, on real gloo ranks.

Each mode runs once per world size (1d at P=4 and P=8, 2d at q=2 / P=4, 2.5d at q=2, d=2 / P=8);
inside that one spawn every layer (linear with and without bias, layer norm, attention, MLP,
embedding, head, a whole GPT block and a one-block GPT with its loss) is checked: forward output and
the gradients of the input and of every parameter shard, against the dense layer from the same
weights. The same run checks the ledger's counts for one linear layer against the derivation below.

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
  = I*O this is 3(q-1)(d+1)/(d q) * S/q, the Tesseract paper's cost in units of S/q.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from tests.gloo import run_ranks
from trainer.config import ModelConfig, TensorConfig
from trainer.models import Block, build_model, lm_loss
from trainer.tensor import comm, layers_1d, layers_25d
from trainer.tensor.block import global_loss, local_batch, loss_fn, shard_block, shard_model, slicers
from trainer.tensor.mesh import Mesh1D, MeshGrid, grid_mesh_from_config

B, T, D, H = 4, 8, 32, 8
N_IN, N_OUT = 32, 48


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


def _ledger_phases(layer: str) -> dict[str, tuple[int, Fraction]]:
    return {
        ph: (comm.LEDGER.total(layer=layer, phase=ph).calls, comm.LEDGER.total(layer=layer, phase=ph).sent)
        for ph in ("fwd", "bwd")
    }


def _compare(
    *,
    dense: nn.Module,
    tp: nn.Module,
    x: torch.Tensor,
    x_local: torch.Tensor,
    out_shard,
    in_shard,
    float_input: bool = True,
) -> None:
    """Forward both, backward a fixed random weighting of the outputs, compare everything."""
    x = x.clone().requires_grad_(float_input)
    y = dense(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * g).sum().backward()

    x_local = x_local.detach().clone().requires_grad_(float_input)
    y_local = tp(x_local)
    assert_close(y_local, out_shard(y.detach()))
    (y_local * out_shard(g)).sum().backward()
    if float_input:
        assert_close(x_local.grad, in_shard(x.grad))
    dense_params = dict(dense.named_parameters())
    for name, fn in slicers(tp).items():
        p = dict(tp.named_parameters())[name]
        assert_close(p.grad, fn(dense_params[name].grad), msg=lambda m, n=name: f"{n}: {m}")


def _check(rank: int, world_size: int, tensor: TensorConfig) -> dict:
    torch.manual_seed(0)
    mesh = grid_mesh_from_config(tensor)
    cfg = ModelConfig(layers=1, d_model=D, heads=H, seq_len=T, mlp_ratio=2)
    gpt = build_model(cfg, seed=1)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, 128, (B, T + 1), generator=torch.Generator().manual_seed(4))
    lin_b = nn.Linear(N_IN, N_OUT)
    lin_nb = nn.Linear(N_IN, N_OUT, bias=False)
    x_in = torch.randn(B, T, N_IN, generator=torch.Generator().manual_seed(5))
    ledgers: dict[str, dict] = {}

    if isinstance(mesh, Mesh1D):
        P, r = mesh.size, mesh.rank

        def cols(t: torch.Tensor) -> torch.Tensor:
            return layers_1d.block_of(t, dim=-1, index=r, parts=P)

        def same(t: torch.Tensor) -> torch.Tensor:
            return t

        for lin, tag in ((lin_b, "b"), (lin_nb, "nb")):
            comm.LEDGER.reset()
            col = layers_1d.ColumnLinear(lin, mesh=mesh, name=f"col.{tag}")
            _compare(dense=lin, tp=col, x=x_in, x_local=x_in, out_shard=cols, in_shard=same)
            lin.zero_grad()
            row = layers_1d.RowLinear(lin, mesh=mesh, name=f"row.{tag}")
            _compare(dense=lin, tp=row, x=x_in, x_local=cols(x_in), out_shard=same, in_shard=cols)
            lin.zero_grad()
            ledgers[f"col.{tag}"] = _ledger_phases(f"col.{tag}")
            ledgers[f"row.{tag}"] = _ledger_phases(f"row.{tag}")
        x_shard = same
    else:
        assert isinstance(mesh, MeshGrid)

        def x_shard(t: torch.Tensor) -> torch.Tensor:
            return layers_25d.cols_of(layers_25d.rows_of(t, mesh), mesh)

        for lin, tag in ((lin_b, "b"), (lin_nb, "nb")):
            comm.LEDGER.reset()
            tp = layers_25d.LinearGrid(lin, mesh=mesh, name=f"lin.{tag}")
            _compare(dense=lin, tp=tp, x=x_in, x_local=x_shard(x_in), out_shard=x_shard, in_shard=x_shard)
            ledgers[f"lin.{tag}"] = _ledger_phases(f"lin.{tag}")

    block: Block = gpt[1]
    sub = {"ln": block.ln1, "attn": block.attn, "mlp": block.mlp}
    for name, dense in sub.items():
        tp_block = shard_block(block, mesh=mesh, name="blk")
        tp = {"ln": tp_block.ln1, "attn": tp_block.attn, "mlp": tp_block.mlp}[name]
        _compare(dense=dense, tp=tp, x=x, x_local=x_shard(x), out_shard=x_shard, in_shard=x_shard)
        block.zero_grad()
    tp_block = shard_block(block, mesh=mesh, name="blk")
    _compare(dense=block, tp=tp_block, x=x, x_local=x_shard(x), out_shard=x_shard, in_shard=x_shard)
    block.zero_grad()

    # embedding (integer input: no input gradient) and head (logits: full vocabulary, own rows)
    tp_model = shard_model(gpt, mesh=mesh)
    idx = ids[:, :-1]
    rows = (lambda t: t) if isinstance(mesh, Mesh1D) else (lambda t: layers_25d.rows_of(t, mesh))
    _compare(
        dense=gpt[0],
        tp=tp_model[0],
        x=idx,
        x_local=rows(idx),
        out_shard=x_shard,
        in_shard=None,
        float_input=False,
    )
    _compare(dense=gpt[2], tp=tp_model[2], x=x, x_local=x_shard(x), out_shard=rows, in_shard=x_shard)
    gpt.zero_grad()
    tp_model.zero_grad()

    # whole one-block GPT with the loss
    targets = ids[:, 1:]
    dense_loss = lm_loss(gpt(idx), targets)
    dense_loss.backward()
    local = loss_fn(
        tp_model(local_batch(idx, mesh=mesh)), local_batch(targets, mesh=mesh), mesh=mesh, global_rows=B
    )
    local.backward()
    assert_close(global_loss(local, mesh=mesh), dense_loss.item())
    dense_params = dict(gpt.named_parameters())
    for name, p in tp_model.named_parameters():
        assert_close(
            p.grad, slicers(tp_model)[name](dense_params[name].grad), msg=lambda m, n=name: f"{n}: {m}"
        )
    return ledgers


CASES = [
    pytest.param(TensorConfig(mode="1d", size=4), id="1d-P4"),
    pytest.param(TensorConfig(mode="1d", size=8), id="1d-P8"),
    pytest.param(TensorConfig(mode="2d", q=2), id="2d-q2-P4"),
    pytest.param(TensorConfig(mode="2.5d", q=2, d=2), id="2.5d-q2-d2-P8"),
]


@pytest.mark.slow
@pytest.mark.parametrize("tensor", CASES)
def test_layers_match_dense_and_ledger_matches_derivation(tensor: TensorConfig) -> None:
    results = run_ranks(_check, world_size=tensor.world_size, args=(tensor,))
    N = B * T
    for ledgers in results:
        if tensor.mode == "1d":
            for tag in ("b", "nb"):
                for kind in ("column", "row"):
                    key = f"{'col' if kind == 'column' else 'row'}.{tag}"
                    want = linear_ledger_1d(kind=kind, P=tensor.size, N=N, n_in=N_IN, n_out=N_OUT)
                    assert ledgers[key] == want, (key, ledgers[key], want)
        else:
            for tag, bias in (("b", True), ("nb", False)):
                want = linear_ledger_grid(q=tensor.q, d=tensor.d, N=N, n_in=N_IN, n_out=N_OUT, bias=bias)
                assert ledgers[f"lin.{tag}"] == want, (tag, ledgers[f"lin.{tag}"], want)
