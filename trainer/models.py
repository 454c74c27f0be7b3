"""Built-in model recipes (trainer/recipe.py): GPT and a character MLP. Each is an ordered list of
layers, so later code can cut it into shards (spilling), stages (pipelines) or shard its layers
(tensor parallelism) by index.

Shape suffixes: B batch, T time (sequence), D d_model, H heads, K head dim (D/H), F feed-forward
width, V vocabulary. Every model maps token ids idx_BT to logits_BTV.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from jobrules.data import CHAR_VOCAB
from jobrules.spec import ModelSpec
from trainer.recipe import ModelRecipe, StackRecipe, build_dense, cross_entropy_loss


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


class GPTRecipe(StackRecipe):
    """Decoder-only transformer: [Embedding, Block x layers, Head]."""

    kind = "gpt"

    def build_layer(self, index: int) -> nn.Module:
        c = self.cfg
        if index == 0:
            return Embedding(vocab_size=c.vocab_size, d_model=c.d_model, seq_len=c.seq_len)
        if index == self.n_layers - 1:
            return Head(d_model=c.d_model, vocab_size=c.vocab_size)
        return Block(d_model=c.d_model, heads=c.heads, mlp_ratio=c.mlp_ratio)

    def tp_hint(self, index: int) -> str | None:
        if index == 0:
            return "embedding"
        return "head" if index == self.n_layers - 1 else "block"


class MLPRecipe(StackRecipe):
    """Position-wise residual MLP on characters: [CharInput, Residual x layers, Head]. It has no
    tensor-parallel form (its layers are not the GPT kinds trainer/tensor shards)."""

    kind = "mlp"

    def build_layer(self, index: int) -> nn.Module:
        c = self.cfg
        if index == 0:
            return CharInput(vocab_size=c.vocab_size, d_model=c.d_model)
        if index == self.n_layers - 1:
            return Head(d_model=c.d_model, vocab_size=c.vocab_size)
        return Residual(d_model=c.d_model, hidden=c.mlp_ratio * c.d_model)


RECIPES: dict[str, Callable[[ModelSpec], ModelRecipe]] = {"gpt": GPTRecipe, "mlp": MLPRecipe}
"""Built-in recipes by `model.kind`."""


def recipe_for(cfg: ModelSpec) -> ModelRecipe:
    """The recipe `model.kind` names, starting from `model.init_from`'s weights when given."""
    recipe = _recipe(cfg)
    if cfg.init_from is not None:
        from trainer.pretrained import Pretrained

        recipe = Pretrained(recipe, path=cfg.init_from)
    return recipe


def _recipe(cfg: ModelSpec) -> ModelRecipe:
    if cfg.kind == "python":
        from trainer.user_model import user_recipe

        return user_recipe(cfg)
    # a job's runner has set vocab_size from its data; a config used on its own (tests,
    # benchmarks) has the char tokenizer's 128
    if cfg.vocab_size is None:
        cfg = cfg.model_copy(update={"vocab_size": CHAR_VOCAB})
    if cfg.kind == "llama":
        from trainer.llama import LlamaRecipe

        return LlamaRecipe(cfg)
    return RECIPES[cfg.kind](cfg)


def build_model(cfg: ModelSpec, *, seed: int) -> nn.Sequential:
    """The whole model from `seed` alone, on CPU (single-process runs and test references): the
    same weights any rank materialises for its own layers (trainer/recipe.py)."""
    return build_dense(recipe_for(cfg), seed=seed)


lm_loss = cross_entropy_loss
"""The GPT and MLP recipes' loss (kept under its old name for tests and benchmarks)."""


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
