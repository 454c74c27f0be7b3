"""ModelRecipe: everything the trainer needs to know about a model, and nothing about how it runs.

A recipe is a small object with five parts; the engines (plain, spilled, offloaded, pipelined,
tensor-parallel, data-parallel and their compositions) use only these:

    n_layers                      how many layers, in order; layer i feeds layer i + 1
    build_layer(i) -> nn.Module   construct layer i on the current default device; the trainer
                                  calls it under `torch.device("meta")`, so it must not read its
                                  own weights or fill buffers from data in the constructor
    init_layer(i, layer, generator=g)
                                  set EVERY floating parameter and buffer of layer i from `g` (the
                                  layer arrives uninitialised, from `to_empty`). `g` is seeded from
                                  (seed, i) alone, so any rank can materialise any layer by itself
                                  and get the weights of the single-process reference
    loss(outputs, targets) -> scalar tensor
                                  the training loss, a MEAN over the batch's rows (and tokens):
                                  micro-batches and data-parallel replicas average their losses,
                                  which equals the full batch's loss only for a mean
    feed(batch) -> (inputs, targets)
                                  how one batch from the data feeds the first layer; the batch's
                                  leading dim is the row dim, which pipelines and data parallelism
                                  split (inputs and targets are tensors with rows first)

and one optional part:

    tp_hint(i) -> str | None      how tensor parallelism may shard layer i: "embedding", "block",
                                  "head" (the GPT layer kinds trainer/tensor knows), or None for
                                  "no tensor-parallel form" (a layout that needs one is refused)

Subclass ModelRecipe and override what differs; GPT and MLP (trainer/models.py) and LLaMA
(trainer/llama.py) are StackRecipes ([input, block x layers, head], GPT-2 init), and a user's own
model is a recipe too. The trainer builds the whole model only for single-process runs and
references (`build_dense`); a parallel rank builds the meta skeleton (`meta_layers`), decides what
it holds, and materialises just those layers (`materialize`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from jobrules.spec import ModelSpec


class RecipeError(RuntimeError):
    """A recipe that breaks its own contract (e.g. init_layer left a tensor unset)."""


class ModelRecipe:
    """Base recipe: override `n_layers`, `build_layer` and `init_layer`; `loss` defaults to mean
    token cross entropy over logits_BTV and targets_BT, `feed` to a batch that is already an
    (inputs, targets) pair, `tp_hint` to "no tensor-parallel form"."""

    kind: str = "custom"
    n_layers: int = 0

    def build_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def init_layer(self, index: int, layer: nn.Module, *, generator: torch.Generator) -> None:
        raise NotImplementedError

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(outputs, targets)

    def feed(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        return inputs, targets

    def tp_hint(self, index: int) -> str | None:
        return None


class StackRecipe(ModelRecipe):
    """[input layer, block x cfg.layers, head], initialised as GPT-2's (gpt2_init): the built-in
    kinds; each says which layers in build_layer."""

    def __init__(self, cfg: ModelSpec) -> None:
        self.cfg = cfg
        self.n_layers = cfg.layers + 2

    def init_layer(self, index: int, layer: nn.Module, *, generator: torch.Generator) -> None:
        gpt2_init(layer, generator=generator, n_layers=self.cfg.layers)


def cross_entropy_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32 logits, whatever the compute dtype)."""
    return F.cross_entropy(logits_BTV.flatten(0, -2).float(), targets_BT.flatten())


def layer_generator(seed: int, index: int) -> torch.Generator:
    """The CPU generator layer `index` is initialised from: a function of (seed, index) only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * (index + 1))


_INITIALISERS = frozenset(  # Tensor methods and torch.nn.init functions
    {"normal_", "uniform_", "trunc_normal_", "fill_", "zero_", "constant_", "ones_", "zeros_"}
    | {"kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_"}
)


class _SkipInitOnMeta(TorchFunctionMode):
    """Skips the in-place initialisers a module's constructor runs on meta tensors. They compute
    nothing there (init_layer initialises every tensor once it is real), yet in torch 2.13 the
    first meta `normal_` (nn.Embedding's) goes through a Python reference that imports torch._dynamo:
    about 2 s of CPU in every process that builds a model, each rank of a parallel job included."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INITIALISERS:
            # torch.nn.init passes its tensor by keyword, Tensor methods as self
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device (shapes only, no memory, no initialisation)."""
    with torch.device("meta"), _SkipInitOnMeta():
        yield


def meta_layers(recipe: ModelRecipe) -> list[nn.Module]:
    """Every layer on the meta device: shapes and parameter counts, no memory."""
    with on_meta():
        return [recipe.build_layer(i) for i in range(recipe.n_layers)]


def materialize_layer(
    recipe: ModelRecipe, index: int, *, seed: int, device: torch.device | str = "cpu"
) -> nn.Module:
    """Layer `index` alone, initialised as in the single-process reference. Built on meta, made
    real on CPU (so the CPU generator gives the same numbers on any device), then moved."""
    with on_meta():
        layer = recipe.build_layer(index)
    layer = layer.to_empty(device="cpu")
    # poison floats first: a tensor init_layer forgets shows up here, not as a quietly wrong run
    with torch.no_grad():
        for _, t in _named_floats(layer):
            t.fill_(math.nan)
        recipe.init_layer(index, layer, generator=layer_generator(seed, index))
    for name, t in _named_floats(layer):
        if torch.isnan(t).any():
            raise RecipeError(f"{recipe.kind} recipe: init_layer({index}) left {name!r} uninitialised")
    return layer.to(device)


def materialize(
    recipe: ModelRecipe, indices: Iterable[int], *, seed: int, device: torch.device | str = "cpu"
) -> list[nn.Module]:
    return [materialize_layer(recipe, i, seed=seed, device=device) for i in indices]


def build_dense(recipe: ModelRecipe, *, seed: int, device: torch.device | str = "cpu") -> nn.Sequential:
    """The whole model as one nn.Sequential (single-process runs and test references only)."""
    return nn.Sequential(*materialize(recipe, range(recipe.n_layers), seed=seed, device=device))


def layer_param_counts(recipe: ModelRecipe) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in meta_layers(recipe)]


def _named_floats(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = [(n, p) for n, p in layer.named_parameters() if p.is_floating_point()]
    out += [(n, b) for n, b in layer.named_buffers() if b.is_floating_point()]
    return out


def gpt2_init(layer: nn.Module, *, generator: torch.Generator, n_layers: int) -> None:
    """GPT-2 style init of one layer: matrices N(0, 0.02), residual projections (`*proj.weight`)
    scaled by 1/sqrt(2 * n_layers), biases 0, norm weights 1."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith("proj.weight") else 0.02
                p.normal_(mean=0.0, std=std, generator=generator)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
