"""The bytes each mode must move, worked out from the shapes alone (no processes, no tensors).

The ledger (comm.py) measures; this derives. bench/tensor.py runs real ranks and checks the two are
equal for every mode, shape and rank, then uses the derivation alone for sizes it cannot spawn here
(P = 64) and for the regime table. Counts are per rank, for one GPT block's forward and backward,
fp32 (4 bytes an element), N = batch x sequence rows, D hidden size, F MLP width.

Algorithm model per call (see comm.py): ring all-reduce sends 2(p-1)/p x payload; a flat broadcast
root sends (p-1) x payload, a non-root nothing; a flat reduce non-root sends its payload, the root
nothing. SUMMA rotates roots, so every rank of a q-group is root once per q steps.

1d, P ranks: qkv (column) and fc (column) all-reduce their input gradient (N x D) in backward;
attention proj (row) and MLP proj (row) all-reduce their output (N x D) in forward. Layer norms are
replicated and silent. 4 calls of 4ND bytes each, sent 4 x 2(P-1)/P x 4ND.

2d / 2.5d, q x q x d: n = N/(dq) rows per rank.
  linear I -> O (bias): a = 4 n I/q, w = 4 (O/q)(I/q), b = 4 O/q
    fwd  2q broadcasts (q of a, q of w): sent (q-1)(a+w)
    bwd  2q broadcasts + 2q reduces:     sent 2(q-1)(a+w)
         depth all-reduce of w (d > 1):  sent 2(d-1)/d w
         bias: all-reduce over the column (2(q-1)/q b) and over depth (2(d-1)/d b)
  layer norm: stats all-reduce (n rows x 2 values = 8n bytes) over the row, forward and backward;
    weight and bias gradients all-reduced over the column and over depth (4D/q bytes each).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

F32 = 4


@dataclass(slots=True)
class Cost:
    calls: int = 0
    payload: int = 0
    sent: Fraction = Fraction(0)

    def add(self, calls: int, payload: int, sent: Fraction) -> None:
        self.calls += calls
        self.payload += payload
        self.sent += sent


@dataclass(slots=True)
class LayerCost:
    fwd: Cost = field(default_factory=Cost)
    bwd: Cost = field(default_factory=Cost)

    @property
    def total(self) -> Cost:
        t = Cost()
        for c in (self.fwd, self.bwd):
            t.add(c.calls, c.payload, c.sent)
        return t


def _all_reduce(c: Cost, nbytes: int, p: int) -> None:
    if p > 1:
        c.add(1, nbytes, Fraction(2 * (p - 1) * nbytes, p))


def linear_1d(*, kind: str, P: int, N: int, n_in: int, n_out: int) -> LayerCost:
    out = LayerCost()
    if kind == "column":
        _all_reduce(out.bwd, F32 * N * n_in, P)
    else:
        _all_reduce(out.fwd, F32 * N * n_out, P)
    return out


def linear_grid(
    *, q: int, d: int, N: int, n_in: int, n_out: int, bias: bool = True, depth_allreduce: bool = True
) -> LayerCost:
    """`depth_allreduce=False` leaves out the weight-gradient all-reduce over depth (which the
    Tesseract cost model does not count; it can be deferred to once per optimizer step)."""
    n = N // (d * q)
    a, w, b = F32 * n * n_in // q, F32 * (n_out // q) * (n_in // q), F32 * n_out // q
    out = LayerCost()
    if q > 1:
        out.fwd.add(2 * q, q * (a + w), Fraction((q - 1) * (a + w)))
        out.bwd.add(4 * q, 2 * q * (a + w), Fraction(2 * (q - 1) * (a + w)))
    if depth_allreduce:
        _all_reduce(out.bwd, w, d)
    if bias:
        _all_reduce(out.bwd, b, q)
        _all_reduce(out.bwd, b, d)
    return out


def layernorm_grid(*, q: int, d: int, N: int, D: int) -> LayerCost:
    n = N // (d * q)
    out = LayerCost()
    _all_reduce(out.fwd, F32 * 2 * n, q)
    _all_reduce(out.bwd, F32 * 2 * n, q)
    for _ in ("weight", "bias"):
        _all_reduce(out.bwd, F32 * D // q, q)
        _all_reduce(out.bwd, F32 * D // q, d)
    return out


@dataclass(kw_only=True, slots=True)
class BlockShape:
    N: int
    """Rows: batch x sequence (the whole global batch)."""
    D: int
    F: int


def block_costs(
    mode: str, *, shape: BlockShape, P: int = 1, q: int = 1, d: int = 1, depth_allreduce: bool = True
) -> dict[str, LayerCost]:
    """Per sub-layer costs of one GPT block (names as the ledger's, relative to the block)."""
    N, D, F = shape.N, shape.D, shape.F
    if mode == "1d":
        return {
            "ln1": LayerCost(),
            "attn.qkv": linear_1d(kind="column", P=P, N=N, n_in=D, n_out=3 * D),
            "attn.proj": linear_1d(kind="row", P=P, N=N, n_in=D, n_out=D),
            "ln2": LayerCost(),
            "mlp.fc": linear_1d(kind="column", P=P, N=N, n_in=D, n_out=F),
            "mlp.proj": linear_1d(kind="row", P=P, N=N, n_in=F, n_out=D),
        }
    kw = {"q": q, "d": d, "N": N, "depth_allreduce": depth_allreduce}
    return {
        "ln1": layernorm_grid(q=q, d=d, N=N, D=D),
        "attn.qkv": linear_grid(n_in=D, n_out=3 * D, **kw),
        "attn.proj": linear_grid(n_in=D, n_out=D, **kw),
        "ln2": layernorm_grid(q=q, d=d, N=N, D=D),
        "mlp.fc": linear_grid(n_in=D, n_out=F, **kw),
        "mlp.proj": linear_grid(n_in=F, n_out=D, **kw),
    }


def block_total(costs: dict[str, LayerCost]) -> LayerCost:
    out = LayerCost()
    for c in costs.values():
        out.fwd.add(c.fwd.calls, c.fwd.payload, c.fwd.sent)
        out.bwd.add(c.bwd.calls, c.bwd.payload, c.bwd.sent)
    return out


def block_param_bytes(mode: str, *, shape: BlockShape, P: int = 1, q: int = 1) -> int:
    """Parameter bytes one rank holds for one block."""
    D, F = shape.D, shape.F
    weights = 3 * D * D + D * D + F * D + D * F
    if mode == "1d":
        split_bias = 3 * D + F  # column-parallel biases are split
        replicated = D + D + 4 * D  # row-parallel biases and both layer norms
        return F32 * ((weights + split_bias) // P + replicated)
    vectors = 3 * D + D + F + D + 4 * D  # biases and layer norms: split over columns only
    return F32 * (weights // (q * q) + vectors // q)


def block_activation_bytes(mode: str, *, shape: BlockShape, q: int = 1, d: int = 1) -> int:
    """Bytes of one rank's block input x_BTD (1d: replicated; grid: one (dq) x q block)."""
    if mode == "1d":
        return F32 * shape.N * shape.D
    return F32 * (shape.N // (d * q)) * (shape.D // q)


def dense_block_bytes(shape: BlockShape) -> tuple[int, int]:
    """(parameter bytes, input activation bytes) of the dense block."""
    D, F = shape.D, shape.F
    params = 3 * D * D + 3 * D + D * D + D + F * D + F + D * F + D + 4 * D
    return F32 * params, F32 * shape.N * shape.D


def paper_bandwidth(mode: str, *, P: int = 1, q: int = 1, d: int = 1) -> Fraction:
    """The Tesseract paper / ColossalAI normalised per-matmul bandwidth cost, converted to units of
    S, the bytes of one operand, assuming square operands (N = I = O): the 2-D and 2.5-D figures
    are in units of a rank's share S/q, so they are divided by q here."""
    if mode == "1d":
        return Fraction(2 * (P - 1), P)
    if mode == "2d":
        return Fraction(6 * (q - 1), q * q)
    return Fraction(3 * (q - 1) * (d + 1), d * q * q)
