"""A Llama-style decoder as a built-in recipe: RMSNorm, rotary position embedding, SwiGLU MLP and
grouped-query attention, as an ordered list of layers [TokenEmbedding, LlamaBlock x layers,
LlamaHead] so spilling, pipelines, selection and tensor parallelism cut it like GPT.

Shape suffixes: B batch, T time, D d_model, H query heads, G key/value heads (H % G == 0),
K head dim (D/H), F SwiGLU width, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jobrules.models import swiglu_width
from jobrules.spec import ModelSpec
from trainer.recipe import StackRecipe

ROPE_BASE = 10_000.0


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32."""

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotate(x_BHTK: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the pairs (first half, second half) of the head dim. The
    angles are computed here from T, not held in a buffer, so a layer built on the meta device
    has nothing to fill and any rank computes the same numbers."""
    T, K = x_BHTK.shape[-2], x_BHTK.shape[-1]
    inv_freq = ROPE_BASE ** (-torch.arange(0, K, 2, device=x_BHTK.device, dtype=torch.float32) / K)
    angles_TK = torch.outer(torch.arange(T, device=x_BHTK.device, dtype=torch.float32), inv_freq)
    cos, sin = angles_TK.cos(), angles_TK.sin()
    x1, x2 = x_BHTK.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x_BHTK)


class GQAttention(nn.Module):
    """Causal grouped-query attention: H query heads share G key/value heads."""

    def __init__(self, *, d_model: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.q = nn.Linear(d_model, heads * self.head_dim, bias=False)
        self.k = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(heads * self.head_dim, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        y_BTc = attend(self.q(x_BTD), self.k(x_BTD), self.v(x_BTD), head_dim=self.head_dim)
        return self.proj(y_BTc)


def attend(q_BTc: torch.Tensor, k_BTg: torch.Tensor, v_BTg: torch.Tensor, *, head_dim: int) -> torch.Tensor:
    """Rotary causal attention of whole heads: q holds H heads, k and v G heads (query head h reads
    key/value head h // (H/G)). Head counts come from the widths, so a tensor-parallel rank holding
    a contiguous slice of query heads and their key/value heads calls this as it is."""
    B, T, _ = q_BTc.shape
    K = head_dim
    H, G = q_BTc.shape[-1] // K, k_BTg.shape[-1] // K
    q_BHTK = rotate(q_BTc.view(B, T, H, K).transpose(1, 2))
    k_BGTK = rotate(k_BTg.view(B, T, G, K).transpose(1, 2))
    v_BGTK = v_BTg.view(B, T, G, K).transpose(1, 2)
    if G != H:
        k_BGTK = k_BGTK.repeat_interleave(H // G, dim=1)
        v_BGTK = v_BGTK.repeat_interleave(H // G, dim=1)
    y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, is_causal=True)
    return y_BHTK.transpose(1, 2).reshape(B, T, H * K)


class SwiGLU(nn.Module):
    """proj(silu(gate(x)) * up(x))."""

    def __init__(self, *, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x_BTD)) * self.up(x_BTD))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, *, d_model: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = GQAttention(d_model=d_model, heads=heads, kv_heads=kv_heads)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model=d_model, hidden=hidden)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class TokenEmbedding(nn.Module):
    """idx_BT -> x_BTD (positions come from the rotary embedding inside attention)."""

    def __init__(self, *, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.tok(idx_BT)


class LlamaHead(nn.Module):
    """Final RMSNorm and vocabulary projection: x_BTD -> logits_BTV."""

    def __init__(self, *, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = RMSNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x_BTD))


class LlamaRecipe(StackRecipe):
    """[TokenEmbedding, LlamaBlock x layers, LlamaHead]; init as GPT-2's (N(0, 0.02), residual
    projections scaled by 1/sqrt(2 * layers), norm weights 1)."""

    kind = "llama"

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__(cfg)
        self.kv_heads = cfg.kv_heads or cfg.heads
        self.hidden = swiglu_width(cfg.d_model, cfg.mlp_ratio)

    def build_layer(self, index: int) -> nn.Module:
        c = self.cfg
        assert c.vocab_size is not None
        if index == 0:
            return TokenEmbedding(vocab_size=c.vocab_size, d_model=c.d_model)
        if index == self.n_layers - 1:
            return LlamaHead(d_model=c.d_model, vocab_size=c.vocab_size)
        return LlamaBlock(d_model=c.d_model, heads=c.heads, kv_heads=self.kv_heads, hidden=self.hidden)

    def tp_hint(self, index: int) -> str | None:
        if index == 0:
            return "llama-embedding"
        return "llama-head" if index == self.n_layers - 1 else "llama-block"
