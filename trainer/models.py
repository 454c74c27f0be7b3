"""Model registry. Every model is an `nn.Sequential` of layers, so later code can cut it into
shards (spilling), stages (pipelines) or shard its layers (tensor parallelism) by index.

Shape suffixes: B batch, T time (sequence), D d_model, H heads, K head dim (D/H), F feed-forward
width, V vocabulary. Every model maps token ids idx_BT to logits_BTV.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from jobrules.data import CHAR_VOCAB
from trainer.config import ModelConfig


class Embedding(nn.Module):
    """Token plus learned position embedding: idx_BT -> x_BTD."""

    def __init__(self, *, vocab_size: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        T = idx_BT.shape[1]
        pos_T = torch.arange(T, device=idx_BT.device)
        return self.tok(idx_BT) + self.pos(pos_T)


class Attention(nn.Module):
    """Causal multi-head self-attention: x_BTD -> y_BTD."""

    def __init__(self, *, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        H = self.heads
        q_BTD, k_BTD, v_BTD = self.qkv(x_BTD).split(D, dim=-1)
        # (B, T, H, K) -> (B, H, T, K) for scaled_dot_product_attention
        q_BHTK = q_BTD.view(B, T, H, D // H).transpose(1, 2)
        k_BHTK = k_BTD.view(B, T, H, D // H).transpose(1, 2)
        v_BHTK = v_BTD.view(B, T, H, D // H).transpose(1, 2)
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        y_BTD = y_BHTK.transpose(1, 2).reshape(B, T, D)
        return self.proj(y_BTD)


class MLP(nn.Module):
    """Feed-forward sub-block: x_BTD -> GELU(x W1 + b1) W2 + b2."""

    def __init__(self, *, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x_BTD)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, *, d_model: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model=d_model, heads=heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model=d_model, hidden=mlp_ratio * d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        return x_BTD + self.mlp(self.ln2(x_BTD))


class Head(nn.Module):
    """Final layer norm and vocabulary projection: x_BTD -> logits_BTV."""

    def __init__(self, *, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x_BTD))


class CharInput(nn.Module):
    """Token embedding only (the MLP model has no notion of position)."""

    def __init__(self, *, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.tok(idx_BT)


class Residual(nn.Module):
    """x + MLP(LayerNorm(x)): one hidden layer of the MLP model."""

    def __init__(self, *, d_model: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model=d_model, hidden=hidden)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return x_BTD + self.mlp(self.ln(x_BTD))


def build_gpt(cfg: ModelConfig) -> nn.Sequential:
    layers: list[nn.Module] = [Embedding(vocab_size=cfg.vocab_size, d_model=cfg.d_model, seq_len=cfg.seq_len)]
    layers += [
        Block(d_model=cfg.d_model, heads=cfg.heads, mlp_ratio=cfg.mlp_ratio) for _ in range(cfg.layers)
    ]
    layers.append(Head(d_model=cfg.d_model, vocab_size=cfg.vocab_size))
    return nn.Sequential(*layers)


def build_mlp(cfg: ModelConfig) -> nn.Sequential:
    hidden = cfg.mlp_ratio * cfg.d_model
    layers: list[nn.Module] = [CharInput(vocab_size=cfg.vocab_size, d_model=cfg.d_model)]
    layers += [Residual(d_model=cfg.d_model, hidden=hidden) for _ in range(cfg.layers)]
    layers.append(Head(d_model=cfg.d_model, vocab_size=cfg.vocab_size))
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[ModelConfig], nn.Sequential]] = {"gpt": build_gpt, "mlp": build_mlp}


def init_weights(model: nn.Module, *, n_layers: int) -> None:
    """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


def build_model(cfg: ModelConfig, *, seed: int) -> nn.Sequential:
    """Build and initialise the model from `seed` alone, on CPU, so every rank, shard and
    reference built from the same config holds bit-identical weights. A job's runner has set
    vocab_size from its data; a config used on its own has the char tokenizer's 128."""
    if cfg.vocab_size is None:
        cfg = dataclasses.replace(cfg, vocab_size=CHAR_VOCAB)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = MODELS[cfg.kind](cfg)
    init_weights(model, n_layers=cfg.layers)
    torch.random.set_rng_state(gen_state)
    return model


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross entropy."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
