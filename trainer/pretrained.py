"""`model.init_from`: initial weights from a local safetensors or torch file (fine-tuning).

The file holds the model's state dict with nn.Sequential's keys (`<layer index>.<name>`), as the
trainer's own checkpoints do (a checkpoint's {"model": ...} is accepted as is). The weights come in
through the recipe's init_layer, so every engine (plain, spilled, pipelined, tensor-parallel, a
selection's trials) gets them for the layers it materialises, and only those are read.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobrules.spec import SpecError
from trainer.recipe import ModelRecipe
from trainer.workspace import resolve_path


@functools.lru_cache(maxsize=2)
def _torch_state(path: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same error to the user
        raise SpecError(f"model.init_from: cannot read {path} as a torch state dict ({e})") from e
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise SpecError(f"model.init_from: {path} does not hold a state dict")
    return state


class WeightFile:
    """Tensors of one file by key, read on demand (safetensors reads only the asked-for tensors)."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise SpecError(f"model.init_from: no file at {path}")
        self.path = path
        if path.suffix == ".safetensors":
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(path), framework="pt") as f:
                    self.keys = set(f.keys())
            except (SafetensorError, OSError) as e:
                raise SpecError(f"model.init_from: {path} is not a safetensors file ({e})") from e
        else:
            self.keys = set(_torch_state(str(path)))

    def get(self, key: str) -> torch.Tensor:
        if self.path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(self.path), framework="pt") as f:
                return f.get_tensor(key)
        return _torch_state(str(self.path))[key]


class Pretrained(ModelRecipe):
    """A recipe whose layers start from a weight file instead of the recipe's own init."""

    def __init__(self, inner: ModelRecipe, *, path: str) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.n_layers = inner.n_layers
        self.file = WeightFile(resolve_path(path, field="model.init_from"))
        expected = {f"{i}." for i in range(inner.n_layers)}
        if not any(k.split(".", 1)[0] + "." in expected for k in self.file.keys):
            raise SpecError(
                f"model.init_from: {path} has no keys of this model's layers ('0.…' to "
                f"'{inner.n_layers - 1}.…'); e.g. {sorted(self.file.keys)[:3]}"
            )

    def __getattr__(self, name: str) -> Any:  # everything else (feed, tp hints, fields) is the inner recipe's
        return getattr(self.__dict__["inner"], name)

    def build_layer(self, index: int) -> nn.Module:
        return self.inner.build_layer(index)

    def init_layer(self, index: int, layer: nn.Module, *, generator: torch.Generator) -> None:
        with torch.no_grad():
            for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
                key = f"{index}.{name}"
                if key not in self.file.keys:
                    if t.is_floating_point():
                        raise SpecError(f"model.init_from: {self.file.path} has no tensor {key!r}")
                    continue
                src = self.file.get(key)
                if tuple(src.shape) != tuple(t.shape):
                    raise SpecError(
                        f"model.init_from: {key!r} has shape {tuple(src.shape)} in the file, "
                        f"{tuple(t.shape)} in the model"
                    )
                t.copy_(src)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner.loss(outputs, targets)

    def feed(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.feed(batch)

    def tp_hint(self, index: int) -> str | None:
        return self.inner.tp_hint(index)
