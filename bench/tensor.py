"""Tensor parallelism: bytes and collectives per rank per GPT block, 1d vs 2d vs 2.5d, measured by
the ledger on real gloo ranks, checked equal to the derivation (trainer/tensor/accounting.py), set
beside the Tesseract/ColossalAI normalised cost model, and the regime where 2.5d sends least.

    .venv/bin/python -m bench.tensor            # P = 4, 8, 16 spawned; P = 64 derived (dry run)
    .venv/bin/python -m bench.tensor --max-p 8  # spawn only P = 4 and 8

Shapes: batch 32 x sequence 4 (N = 128 rows), hidden D = 128, 16 heads, MLP width F = 512, fp32.
N = D, so the one-linear comparison with the cost model is at its own square-operand assumption.
Timings of the local matmuls need a GPU; none was available for these runs (the rows are pending).
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction
from typing import Any

import torch

from bench.common import table, write_results
from jobrules.spec import TensorSpec
from trainer.tensor.accounting import (
    BlockShape,
    LayerCost,
    block_activation_bytes,
    block_costs,
    block_param_bytes,
    block_total,
    dense_block_bytes,
    linear_1d,
    linear_grid,
    paper_bandwidth,
)

B, T, D, H, RATIO = 32, 4, 128, 16, 4
SHAPE = BlockShape(N=B * T, D=D, F=RATIO * D)

# The regime where 2.5d should send least (see regime_rows): P = 16, N/h >= 4. The smallest block
# that every P = 16 layout can shard: h = 32 with 16 heads (1d splits heads 16 ways), F = 4h;
# batch x sequence 8 x 16 (N/h = 4) and 16 x 16 (N/h = 8), batches divisible by d*q = 8.
REGIME_H, REGIME_HEADS = 32, 16
REGIME_BT = [(8, 16), (16, 16)]

SPAWNED: dict[int, list[TensorSpec]] = {
    4: [TensorSpec(mode="1d", size=4), TensorSpec(mode="2d", q=2)],
    8: [TensorSpec(mode="1d", size=8), TensorSpec(mode="2.5d", q=2, d=2)],
    16: [TensorSpec(mode="1d", size=16), TensorSpec(mode="2d", q=4), TensorSpec(mode="2.5d", q=2, d=4)],
}
DRY_RUN: dict[int, list[TensorSpec]] = {
    64: [
        TensorSpec(mode="1d", size=64),
        TensorSpec(mode="2d", q=8),
        TensorSpec(mode="2.5d", q=4, d=4),
        TensorSpec(mode="2.5d", q=2, d=16),
    ],
}


def _key(t: TensorSpec) -> str:
    return f"1d P={t.size}" if t.mode == "1d" else f"{t.mode} q={t.q} d={t.d}"


# ---- inside each rank --------------------------------------------------------------------------


def socket_bytes() -> int:
    """Bytes this process has written through write(2)/writev(2), sockets included (Linux
    /proc/self/io `wchar`): gloo's TCP transport writes every message that way, so the difference
    over a window with no file or console output is what this rank put on the wire, headers
    included, under gloo's real algorithms (ring all-reduce, binomial-tree broadcast, ...)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _block_ledger(records: dict) -> dict[str, dict[str, tuple[int, int, Fraction]]]:
    by_layer: dict[str, dict[str, tuple[int, int, Fraction]]] = {}
    for (layer, phase, _), c in records.items():
        entry = by_layer.setdefault(layer, {})
        calls, payload, sent = entry.get(phase, (0, 0, Fraction(0)))
        entry[phase] = (calls + c.calls, payload + c.payload, sent + c.sent)
    return by_layer


def _measure(
    rank: int, world_size: int, configs: list[TensorSpec], regime: list[tuple[int, int]] | None = None
) -> dict[str, Any]:
    """Per config: the main shape's block + one square linear (ledger), and, for each (B, T) of
    `regime`, a block of hidden size REGIME_H (ledger and socket bytes, fwd + bwd)."""
    import torch.distributed as dist
    from torch import nn

    from trainer.models import Block
    from trainer.tensor import comm, layers_1d, layers_25d
    from trainer.tensor.block import local_batch, shard_block
    from trainer.tensor.grid import Grid1D, tensor_grid_for

    torch.manual_seed(0)
    dense = Block(d_model=D, heads=H, mlp_ratio=RATIO)
    square = nn.Linear(D, D, bias=False)
    x_BTD = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    small = Block(d_model=REGIME_H, heads=REGIME_HEADS, mlp_ratio=RATIO)
    out: dict[str, Any] = {"regime": {}}
    for tensor in configs:
        grid = tensor_grid_for(tensor)

        def shard(t: torch.Tensor, grid: Any = grid) -> torch.Tensor:
            if isinstance(grid, Grid1D):
                return t
            return layers_25d.cols_of(local_batch(t, grid=grid), grid)

        x_local = shard(x_BTD)
        if isinstance(grid, Grid1D):
            lin = layers_1d.RowLinear(square, grid=grid, name="lin")
            lin_in = layers_1d.block_of(x_BTD, dim=-1, index=grid.rank, parts=grid.size)
        else:
            lin = layers_25d.LinearGrid(square, grid=grid, name="lin")
            lin_in = x_local
        block = shard_block(dense, grid=grid, name="blk")
        comm.LEDGER.reset()
        dist.barrier()
        w0 = socket_bytes()
        y = block(x_local.clone().requires_grad_())
        y.square().sum().backward()
        w1 = socket_bytes()
        dist.barrier()
        lin(lin_in.clone().requires_grad_()).sum().backward()
        depth = sum(
            (
                c.sent
                for (layer, ph, op), c in comm.LEDGER.records.items()
                if layer == "lin" and op == "all_reduce"
            ),
            Fraction(0),
        )
        out[_key(tensor)] = {
            "by_layer": _block_ledger(comm.LEDGER.records),
            "socket_bytes": w1 - w0,
            "param_bytes": sum(p.numel() * p.element_size() for p in block.parameters()),
            "act_bytes": x_local.numel() * x_local.element_size(),
            "linear_depth_sent": depth if tensor.mode != "1d" else Fraction(0),
        }
        small_tp = shard_block(small, grid=grid, name="blk")
        for b, t in regime or []:
            x = torch.randn(b, t, REGIME_H, generator=torch.Generator().manual_seed(2))
            x_local = shard(x).clone().requires_grad_()
            comm.LEDGER.reset()
            dist.barrier()
            w0 = socket_bytes()
            small_tp(x_local).square().sum().backward()
            w1 = socket_bytes()
            dist.barrier()
            out["regime"][f"{_key(tensor)}|{b}x{t}"] = {
                "by_layer": _block_ledger(comm.LEDGER.records),
                "socket_bytes": w1 - w0,
            }
    return out


# ---- derivation side ---------------------------------------------------------------------------


def derived(
    tensor: TensorSpec, *, shape: BlockShape = SHAPE, depth_allreduce: bool = True
) -> dict[str, LayerCost]:
    if tensor.mode == "1d":
        return block_costs("1d", shape=shape, P=tensor.size)
    return block_costs(tensor.mode, shape=shape, q=tensor.q, d=tensor.d, depth_allreduce=depth_allreduce)


def derived_linear(tensor: TensorSpec) -> LayerCost:
    if tensor.mode == "1d":
        return linear_1d(kind="row", P=tensor.size, N=SHAPE.N, n_in=D, n_out=D)
    return linear_grid(q=tensor.q, d=tensor.d, N=SHAPE.N, n_in=D, n_out=D, bias=False)


def _as_tuple(c: Any) -> tuple[int, int, Fraction]:
    return (c.calls, c.payload, c.sent)


def _num(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def compare(tensor: TensorSpec, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's ledger against the derivation, sub-layer by sub-layer and phase by phase."""
    want = derived(tensor)
    key = _key(tensor)
    mismatches = []
    for r, out in enumerate(ranks):
        got = out[key]["by_layer"]
        for sub, cost in want.items():
            for phase in ("fwd", "bwd"):
                g = got.get(f"blk.{sub}", {}).get(phase, (0, 0, Fraction(0)))
                w = _as_tuple(getattr(cost, phase))
                if g != w:
                    mismatches.append(f"rank {r} {sub} {phase}: measured {g} derived {w}")
        lin_w = _as_tuple(derived_linear(tensor).total)
        lin = got.get("lin", {})
        lin_g = tuple(
            sum(x) for x in zip(*(lin.get(ph, (0, 0, Fraction(0))) for ph in ("fwd", "bwd")), strict=True)
        )
        if lin_g != lin_w:
            mismatches.append(f"rank {r} square linear: measured {lin_g} derived {lin_w}")
        if out[key]["param_bytes"] != block_param_bytes(tensor.mode, shape=SHAPE, P=tensor.size, q=tensor.q):
            mismatches.append(f"rank {r} param bytes {out[key]['param_bytes']}")
        if out[key]["act_bytes"] != block_activation_bytes(tensor.mode, shape=SHAPE, q=tensor.q, d=tensor.d):
            mismatches.append(f"rank {r} activation bytes {out[key]['act_bytes']}")
    return {"equal": not mismatches, "mismatches": mismatches[:20]}


def block_row(
    tensor: TensorSpec, *, P: int, measured: list[dict[str, Any]] | None, check: dict[str, Any] | None
) -> dict[str, Any]:
    tot = block_total(derived(tensor))
    params, acts = dense_block_bytes(SHAPE)
    p_bytes = block_param_bytes(tensor.mode, shape=SHAPE, P=tensor.size, q=tensor.q)
    a_bytes = block_activation_bytes(tensor.mode, shape=SHAPE, q=tensor.q, d=tensor.d)
    sockets: Any = "dry run"
    if measured is not None:
        per_rank = [out[_key(tensor)]["socket_bytes"] for out in measured]
        sockets = round(sum(per_rank) / len(per_rank))
        sents = set()
        for out in measured:
            layers = out[_key(tensor)]["by_layer"]
            sents.add(
                sum(
                    (v[2] for k, ph in layers.items() if k.startswith("blk.") for v in ph.values()),
                    Fraction(0),
                )
            )
        sent_measured: Any = " / ".join(str(_num(s)) for s in sorted(sents))
    else:
        sent_measured = "dry run"
    model_param = {"1d": Fraction(1, P), "2d": Fraction(1, tensor.q**2), "2.5d": Fraction(1, tensor.q**2)}[
        tensor.mode
    ]
    model_act = {
        "1d": Fraction(1),
        "2d": Fraction(1, tensor.q**2),
        "2.5d": Fraction(1, tensor.d * tensor.q**2),
    }[tensor.mode]
    return {
        "P": P,
        "mode": _key(tensor),
        "calls fwd/bwd": f"{tot.fwd.calls}/{tot.bwd.calls}",
        "sent B measured": sent_measured,
        "sent B derived": _num(tot.total.sent),
        "socket B (gloo, mean/rank)": sockets,
        "equal": ("yes" if check["equal"] else "NO") if check is not None else "-",
        "param B": p_bytes,
        "param/dense": round(p_bytes / params, 4),
        "model": str(model_param),
        "act B": a_bytes,
        "act/dense": round(a_bytes / acts, 4),
        "model ": str(model_act),
    }


def sublayer_rows(P: int, measured: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    rows = []
    for t in SPAWNED[P]:
        want = derived(t)
        got = measured[0][_key(t)]["by_layer"] if measured is not None else None
        for sub, cost in want.items():
            row: dict[str, Any] = {"mode": _key(t), "layer": sub}
            for ph in ("fwd", "bwd"):
                c = getattr(cost, ph)
                row[f"{ph} calls"] = c.calls
                row[f"{ph} sent B derived"] = _num(c.sent)
                if got is not None:
                    g = got.get(f"blk.{sub}", {}).get(ph, (0, 0, Fraction(0)))
                    row[f"{ph} sent B measured"] = _num(g[2])
            rows.append(row)
    return rows


def model_row(tensor: TensorSpec, *, P: int, measured: list[dict[str, Any]] | None) -> dict[str, Any]:
    S = 4 * SHAPE.N * D  # one operand's bytes: N = D, so activation and weight are the same size
    lin = derived_linear(tensor).total.sent
    depth = Fraction(0)
    if tensor.mode != "1d":
        depth = Fraction(2 * (tensor.d - 1) * 4 * (D // tensor.q) ** 2, tensor.d)
    if measured is not None:
        meas = {
            _num(sum((v[2] for v in out[_key(tensor)]["by_layer"]["lin"].values()), Fraction(0)))
            for out in measured
        }
        m: Any = " / ".join(str(x) for x in sorted(meas))
    else:
        m = "dry run"
    model = paper_bandwidth(tensor.mode, P=tensor.size, q=tensor.q, d=tensor.d)
    return {
        "P": P,
        "mode": _key(tensor),
        "sent B (one D x D linear)": m,
        "derived / S": round(float(lin / S), 4),
        "without depth all-reduce / S": round(float((lin - depth) / S), 4),
        "paper model / S": round(float(model), 4),
        "paper formula": {
            "1d": "2(P-1)/P",
            "2d": "6(q-1)/q  [units S/q]",
            "2.5d": "3(q-1)(d+1)/(dq)  [units S/q]",
        }[tensor.mode],
    }


# ---- regime: where 2.5d sends least ------------------------------------------------------------


def _affine(tensor: TensorSpec, *, h: int, depth_allreduce: bool) -> tuple[Fraction, Fraction]:
    """Per-rank bytes per block = alpha + beta * N at hidden size h (every term is linear in N)."""
    unit = 4096 * 64  # divisible by every d*q used here
    c1 = block_total(derived(tensor, shape=BlockShape(N=unit, D=h, F=4 * h), depth_allreduce=depth_allreduce))
    c2 = block_total(
        derived(tensor, shape=BlockShape(N=2 * unit, D=h, F=4 * h), depth_allreduce=depth_allreduce)
    )
    beta = (c2.total.sent - c1.total.sent) / unit
    return c1.total.sent - beta * unit, beta


def threshold(a: TensorSpec, b: TensorSpec, *, h: int, depth_allreduce: bool) -> Fraction | None:
    """Smallest N/h above which `a` sends fewer bytes than `b` (None: never; 0: always)."""
    a0, a1 = _affine(a, h=h, depth_allreduce=depth_allreduce)
    b0, b1 = _affine(b, h=h, depth_allreduce=depth_allreduce)
    if a1 >= b1:
        return Fraction(0) if a0 < b0 and a1 == b1 else None
    n_star = (a0 - b0) / (b1 - a1)
    return max(n_star, Fraction(0)) / h


def regime_rows(h: int) -> list[dict[str, Any]]:
    rows = []
    for P, tess in ((8, [(2, 2)]), (16, [(2, 4)]), (64, [(4, 4), (2, 16)]), (256, [(8, 4), (4, 16)])):
        one_d = TensorSpec(mode="1d", size=P)
        q2 = round(P**0.5)
        two_d = TensorSpec(mode="2d", q=q2) if q2 * q2 == P else None
        for q, d in tess:
            t = TensorSpec(mode="2.5d", q=q, d=d)
            row: dict[str, Any] = {"P": P, "2.5d": f"q={q} d={d}"}
            for label, dar in (("", True), (" (no depth AR)", False)):
                vs1 = threshold(t, one_d, h=h, depth_allreduce=dar)
                vs2 = threshold(t, two_d, h=h, depth_allreduce=dar) if two_d else Fraction(0)
                both = None if vs1 is None or vs2 is None else max(vs1, vs2)
                row[f"beats 1d if N/h >{label}"] = "never" if vs1 is None else round(float(vs1), 3)
                row[f"beats 2d if N/h >{label}"] = (
                    "no 2d" if two_d is None else ("never" if vs2 is None else round(float(vs2), 3))
                )
                row[f"wins if N/h >{label}"] = "never" if both is None else round(float(both), 3)
            rows.append(row)
    return rows


def sweep_rows(P: int, *, h: int) -> list[dict[str, Any]]:
    modes = [TensorSpec(mode="1d", size=P)]
    q2 = round(P**0.5)
    if q2 * q2 == P:
        modes.append(TensorSpec(mode="2d", q=q2))
    modes += {16: [TensorSpec(mode="2.5d", q=2, d=4)], 64: [TensorSpec(mode="2.5d", q=4, d=4)]}[P]
    rows = []
    for rho in (
        Fraction(1, 8),
        Fraction(1, 2),
        Fraction(1),
        Fraction(2),
        Fraction(4),
        Fraction(16),
        Fraction(64),
    ):
        N = int(rho * h)
        row: dict[str, Any] = {"P": P, "N/h": float(rho)}
        best, best_v = "", None
        for t in modes:
            v = block_total(derived(t, shape=BlockShape(N=N, D=h, F=4 * h))).total.sent / (4 * h * h)
            row[_key(t)] = round(float(v), 3)
            if best_v is None or v < best_v:
                best, best_v = _key(t), v
        row["least"] = best
        rows.append(row)
    return rows


def regime_measured_rows(measured: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """P = 16 at hidden size REGIME_H: per mode and N/h, what every rank's ledger counted (payload:
    real tensors; sent: the algorithm model) and what it wrote to its sockets, checked against the
    derivation."""
    rows, checks = [], {}
    for b, t in REGIME_BT:
        shape = BlockShape(N=b * t, D=REGIME_H, F=RATIO * REGIME_H)
        group = []
        for tensor in SPAWNED[16]:
            key = f"{_key(tensor)}|{b}x{t}"
            want = derived(tensor, shape=shape)
            tot = block_total(want)
            mismatches = []
            payloads, sents, sockets = [], [], []
            for r, out in enumerate(measured):
                got = out["regime"][key]["by_layer"]
                for sub, cost in want.items():
                    for ph in ("fwd", "bwd"):
                        g = got.get(f"blk.{sub}", {}).get(ph, (0, 0, Fraction(0)))
                        if g != _as_tuple(getattr(cost, ph)):
                            mismatches.append(f"rank {r} {sub} {ph}: measured {g}")
                payloads.append(sum(v[1] for ph in got.values() for v in ph.values()))
                sents.append(sum((v[2] for ph in got.values() for v in ph.values()), Fraction(0)))
                sockets.append(out["regime"][key]["socket_bytes"])
            checks[f"P=16 regime {key}"] = {"equal": not mismatches, "mismatches": mismatches[:20]}
            P = len(measured)
            group.append(
                {
                    "N/h": b * t / REGIME_H,
                    "B x T": f"{b} x {t}",
                    "mode": _key(tensor),
                    "calls fwd/bwd": f"{tot.fwd.calls}/{tot.bwd.calls}",
                    "payload B/rank (tensors)": round(sum(payloads) / P),
                    "sent B/rank (model)": round(float(sum(sents, Fraction(0)) / P)),
                    "socket B/rank (gloo)": round(sum(sockets) / P),
                    "socket B max rank": max(sockets),
                    "ledger == derived": "yes" if not mismatches else "NO",
                }
            )
        for col, mark in (
            ("sent B/rank (model)", "least sent (model)"),
            ("socket B/rank (gloo)", "least on sockets"),
        ):
            best = min(group, key=lambda row: row[col])["mode"]
            for row in group:
                row[mark] = "<-" if row["mode"] == best else ""
        rows += group
    return rows, checks


def main() -> None:
    from tests.gloo import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--max-p", type=int, default=16, help="largest world size to spawn (4, 8 or 16)")
    args = ap.parse_args()

    measured: dict[int, list[dict[str, Any]]] = {}
    spawn_s: dict[int, float] = {}
    for P, configs in SPAWNED.items():
        if P > args.max_p:
            continue
        t0 = time.perf_counter()
        regime = REGIME_BT if P == 16 else None
        measured[P] = run_ranks(_measure, world_size=P, args=(configs, regime), timeout_s=900)
        spawn_s[P] = round(time.perf_counter() - t0, 1)

    block_rows, model_rows, checks = [], [], {}
    for P, configs in {**SPAWNED, **DRY_RUN}.items():
        for t in configs:
            meas = measured.get(P)
            check = compare(t, meas) if meas is not None else None
            if check is not None:
                checks[f"P={P} {_key(t)}"] = check
            block_rows.append(block_row(t, P=P, measured=meas, check=check))
            model_rows.append(model_row(t, P=P, measured=meas))

    print(table(block_rows, title=f"Per rank, one GPT block fwd+bwd (N={SHAPE.N}, D={D}, F={SHAPE.F}, fp32)"))
    sub_rows = sublayer_rows(16, measured.get(16))
    print(
        table(
            sub_rows,
            title="P = 16, per sub-layer, per rank: calls and bytes sent, fwd / bwd (rank 0's ledger)",
        )
    )
    print(
        table(
            model_rows,
            title="One D x D linear (no bias) vs the paper's normalised cost, S = 4*N*D bytes, N = D",
        )
    )
    regime_measured: list[dict[str, Any]] = []
    if 16 in measured:
        regime_measured, regime_checks = regime_measured_rows(measured[16])
        checks.update(regime_checks)
        print(
            table(
                regime_measured,
                title=f"Measured on 16 gloo ranks in the regime where 2.5d should send least: one GPT block "
                f"fwd+bwd, h = {REGIME_H}, {REGIME_HEADS} heads, F = {RATIO}h, fp32; per rank (mean over ranks)",
            )
        )
    h = 4096
    regime = regime_rows(h)
    print(
        table(
            regime,
            title=f"Regime: N = batch x sequence over hidden size h = {h} (F = 4h) where 2.5d sends least",
        )
    )
    sweeps = {P: sweep_rows(P, h=h) for P in (16, 64)}
    for P, rows in sweeps.items():
        print(
            table(
                rows,
                title=f"P = {P}: bytes sent per rank per block / (4 h^2), h = {h}; which mode sends least",
            )
        )
    print(
        "GPU local-matmul timings (strong-scaling projection vs 1.38x / 1.53x): pending, no GPU in this run"
    )
    bad = {k: v for k, v in checks.items() if not v["equal"]}
    print(f"measured == derived: {'all equal' if not bad else bad} ({len(checks)} spawned configurations)")
    print(f"spawn+run seconds per world size: {spawn_s}")
    path = write_results(
        "tensor",
        {
            "shape": {"batch": B, "seq": T, "d_model": D, "heads": H, "mlp_width": SHAPE.F, "dtype": "fp32"},
            "block": block_rows,
            "sublayers_P16": sub_rows,
            "cost_model": model_rows,
            "regime_measured_P16": {
                "h": REGIME_H,
                "heads": REGIME_HEADS,
                "mlp_width": RATIO * REGIME_H,
                "batch_x_seq": [f"{b}x{t}" for b, t in REGIME_BT],
                "rows": regime_measured,
            },
            "regime_h": h,
            "regime": regime,
            "sweep": {str(P): rows for P, rows in sweeps.items()},
            "checks": checks,
            "spawn_seconds": spawn_s,
            "dry_run_world_sizes": list(DRY_RUN),
            "gpu_matmul_timing": "pending: no GPU available",
        },
    )
    print(f"wrote {path}")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
