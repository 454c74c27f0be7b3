"""`model.kind: "python"`: a recipe from the user's workspace, and the checks that turn mistakes in
user code into a failed job with the reason (never a worker crash).

The entry point `package.module:function` is called with `model.args` (a selection's search space
may range over them); `vocab_size` and `seq_len` are passed too when the function takes them and
`args` does not set them. It must return a trainer.recipe.ModelRecipe.
"""

from __future__ import annotations

import inspect

import torch

from jobrules.spec import JobSpec, ModelSpec
from trainer.data import data_for
from trainer.recipe import ModelRecipe, meta_layers
from trainer.workspace import UserCodeError, call_entry, load_entry


def user_recipe(cfg: ModelSpec) -> ModelRecipe:
    fn = load_entry(cfg.entry or "", field="model.entry")
    kwargs = dict(cfg.args)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name, value in (("vocab_size", cfg.vocab_size), ("seq_len", cfg.seq_len)):
        if name not in kwargs and (name in params or takes_any):
            kwargs[name] = value
    recipe = call_entry(fn, field="model.entry", **kwargs)
    if not isinstance(recipe, ModelRecipe):
        raise UserCodeError(
            f"model.entry {cfg.entry} must return a trainer.recipe.ModelRecipe, got {type(recipe).__name__}"
        )
    n = getattr(recipe, "n_layers", None)
    if not isinstance(n, int) or n < 1:
        raise UserCodeError(
            f"model.entry {cfg.entry}: the recipe's n_layers must be an integer >= 1, got {n!r}"
        )
    return recipe


def check_recipe(recipe: ModelRecipe, batch: object, *, entry: str) -> None:
    """Run one batch through every layer on the meta device (no memory, no kernels): a layer that
    cannot be built or does not accept its input's shape fails here, before any training, naming
    the layer and the shapes."""
    try:
        layers = meta_layers(recipe)
    except Exception as e:
        raise UserCodeError(f"model.entry {entry}: build_layer failed: {type(e).__name__}: {e}") from e
    if len(layers) != recipe.n_layers:
        raise UserCodeError(
            f"model.entry {entry}: built {len(layers)} layers, n_layers says {recipe.n_layers}"
        )
    try:
        x, y = recipe.feed(batch)
    except Exception as e:
        raise UserCodeError(f"model.entry {entry}: feed(batch) failed: {type(e).__name__}: {e}") from e
    h = x.to("meta")
    for i, layer in enumerate(layers):
        try:
            with torch.no_grad():
                out = layer(h)
        except Exception as e:
            raise UserCodeError(
                f"model.entry {entry}: layer {i} ({type(layer).__name__}) failed on an input of shape "
                f"{tuple(h.shape)} ({h.dtype}): {type(e).__name__}: {e}"
            ) from e
        if not isinstance(out, torch.Tensor):
            raise UserCodeError(
                f"model.entry {entry}: layer {i} ({type(layer).__name__}) must return one tensor, "
                f"got {type(out).__name__}"
            )
        h = out
    try:
        loss = recipe.loss(h, y.to("meta"))
    except Exception as e:
        raise UserCodeError(
            f"model.entry {entry}: loss(outputs {tuple(h.shape)}, targets {tuple(y.shape)}) failed: "
            f"{type(e).__name__}: {e}"
        ) from e
    if loss.dim() != 0:
        raise UserCodeError(
            f"model.entry {entry}: loss must be a scalar (a mean), got shape {tuple(loss.shape)}"
        )


def check_user_model(job: JobSpec, *, recipe: ModelRecipe) -> None:
    """Before any training: one validation batch of the job's data goes through every layer of the
    user's recipe (built by the caller: trainer/models.py's recipe_for imports this module) and the
    loss on the meta device (trainer/data.py's data_for shares the dataset)."""
    batch = data_for(job).batch(
        split="val", batch_size=job.train.batch_size, generator=torch.Generator().manual_seed(0)
    )
    check_recipe(recipe, batch, entry=job.model.entry or "")
