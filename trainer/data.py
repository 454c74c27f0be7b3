"""Character-level text from the Python standard library's own source files.

Real text that is on every machine with Python, so the default job trains on real data with no
download. Characters are ASCII code points (vocabulary 128); anything else becomes '?'.
"""

from __future__ import annotations

import functools
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.config import DataConfig

VOCAB_SIZE = 128
_UNKNOWN = ord("?")


def stdlib_files() -> list[Path]:
    """The standard library's top-level and package .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=4)
def load_corpus(max_chars: int) -> np.ndarray:
    """The corpus as uint8 codes, at most `max_chars` long. Cached per process."""
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_files():
        try:
            text = path.read_bytes()
        except OSError:
            continue
        chunks.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not chunks:
        raise RuntimeError("no standard-library source files found to train on")
    raw = np.frombuffer(b"\n".join(chunks)[:max_chars], dtype=np.uint8).copy()
    raw[raw >= VOCAB_SIZE] = _UNKNOWN
    return raw


def encode(text: str) -> list[int]:
    return [c if c < VOCAB_SIZE else _UNKNOWN for c in text.encode("ascii", errors="replace")]


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("ascii", errors="replace")


@dataclass(slots=True)
class TextData:
    """Train and validation token streams with seeded random batches."""

    train: torch.Tensor
    val: torch.Tensor
    seq_len: int

    @classmethod
    def from_config(cls, cfg: DataConfig, *, seq_len: int) -> TextData:
        codes = torch.from_numpy(load_corpus(cfg.max_chars).astype(np.int64))
        n_val = max(int(len(codes) * cfg.val_fraction), seq_len + 2)
        return cls(train=codes[:-n_val], val=codes[-n_val:], seq_len=seq_len)

    def batch(
        self, *, split: str, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs idx_BT, targets_BT) drawn at offsets from `generator`."""
        source = self.train if split == "train" else self.val
        hi = len(source) - self.seq_len - 1
        starts = torch.randint(0, hi, (batch_size,), generator=generator)
        rows = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = source[rows]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


@dataclass(slots=True)
class BatchStream:
    """Training batch for step k depends on (seed, k) only, so a resumed run or a parallel run
    that draws step k's batch sees the same data as an uninterrupted single-device run."""

    data: TextData
    batch_size: int
    seed: int

    def batch_for(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self.data.batch(split="train", batch_size=self.batch_size, generator=g)
