"""Training data: what `data` in the JobSpec names, as seeded random batches of token windows.

Three kinds (docs/data.md):
- `text`: a corpus tokenized at start and held as one small-integer array: the standard library's
  own sources (`corpus: stdlib`, on every machine, no download) or the user's UTF-8 files
  (`path`); tokenizers `char` (ASCII, vocabulary 128), `byte` (UTF-8 bytes, 256) or a Hugging
  Face `tokenizers` JSON file.
- `tokens`: nanoGPT's train.bin/val.bin (uint16 or uint32 token ids) read through np.memmap: a
  batch copies only its windows, so host memory stays flat whatever the file size.
- `python`: an entry point in the workspace returning (train, val) iterables of batches.

Every dataset has `vocab_size` and `batch(split=, batch_size=, generator=)`; BatchStream makes
step k's batch a function of (seed, k) for the random-window kinds.
"""

from __future__ import annotations

import functools
import itertools
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from jobrules.data import BYTE_VOCAB, CHAR_VOCAB, vocab_problem
from jobrules.spec import DataSpec, JobSpec, SpecError
from trainer.workspace import UserCodeError, call_entry, load_entry, resolve_path

VOCAB_SIZE = CHAR_VOCAB
_UNKNOWN = ord("?")
_SCAN_CHUNK = 1 << 24  # tokens per step of the streaming vocabulary scan (64 MiB of uint32)


class Dataset(Protocol):
    vocab_size: int

    def batch(
        self, *, split: str, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


# ---- tokenizers ---------------------------------------------------------------------------------


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...


class CharTokenizer:
    """ASCII code points; anything else becomes '?'."""

    vocab_size = CHAR_VOCAB

    def encode(self, text: str) -> np.ndarray:
        raw = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8).copy()
        raw[raw >= CHAR_VOCAB] = _UNKNOWN
        return raw


class ByteTokenizer:
    """UTF-8 bytes: every text round-trips, vocabulary 256."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (the file only: nothing is downloaded)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _HF

        if not path.is_file():
            raise SpecError(f"data.tokenizer: no tokenizer file at {path}")
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as e:  # the library raises plain Exception subclasses for bad JSON
            raise SpecError(f"data.tokenizer: {path} is not a tokenizers JSON file ({e})") from e
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)


def make_tokenizer(name: str) -> Tokenizer:
    if name == "char":
        return CharTokenizer()
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(resolve_path(name, field="data.tokenizer"))


def encode(text: str) -> list[int]:
    return CharTokenizer().encode(text).tolist()


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("ascii", errors="replace")


# ---- text ---------------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The standard library's top-level and package .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = []
    # the skipped folders are pruned, not walked and then filtered: site-packages alone can hold
    # tens of thousands of files, and walking them was most of a selection batch's set-up
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_files(path: Path) -> list[Path]:
    """`path` itself, or the files under it (hidden ones skipped) in a fixed order."""
    if path.is_file():
        return [path]
    if not path.exists():
        raise SpecError(f"data.path: {path} does not exist")
    if not path.is_dir():
        raise SpecError(f"data.path: {path} is neither a file nor a folder")
    files = [
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    if not files:
        raise SpecError(f"data.path: the folder {path} holds no files")
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def read_text(files: list[Path], *, max_chars: int, strict: bool) -> str:
    """The files joined by newlines, at most `max_chars` characters. strict: a file that is not
    UTF-8 is an error naming it (the user's data); else it is read with replacement (stdlib)."""
    chunks: list[str] = []
    total = 0
    for path in files:
        try:
            raw = path.read_bytes()
        except OSError as e:
            if strict:
                raise SpecError(f"data.path: cannot read {path}: {e.strerror}") from e
            continue
        try:
            text = raw.decode("utf-8", errors="strict" if strict else "replace")
        except UnicodeDecodeError as e:
            raise SpecError(f"data.path: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from e
        chunks.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(chunks)[:max_chars]


@functools.lru_cache(maxsize=4)
def load_corpus(max_chars: int) -> np.ndarray:
    """The stdlib corpus as char codes (uint8), at most `max_chars` long. Cached per process."""
    text = read_text(stdlib_files(), max_chars=max_chars, strict=False)
    if not text:
        raise RuntimeError("no standard-library source files found to train on")
    return CharTokenizer().encode(text)


@functools.lru_cache(maxsize=4)
def _load_text(path: str, tokenizer: str, max_chars: int, workspace_key: str) -> tuple[np.ndarray, int]:
    tok = make_tokenizer(tokenizer)
    if path == "":
        text = read_text(stdlib_files(), max_chars=max_chars, strict=False)
    else:
        text = read_text(text_files(resolve_path(path, field="data.path")), max_chars=max_chars, strict=True)
    if not text.strip():
        raise SpecError(f"data.path: {path} holds no text")
    ids = tok.encode(text)
    # the smallest dtype that holds every id: a 4-million-token corpus is 8 MB, not 32
    dtype = np.uint8 if tok.vocab_size <= 256 else np.uint16 if tok.vocab_size <= 65536 else np.int32
    return ids.astype(dtype), tok.vocab_size


@dataclass(slots=True)
class TextData:
    """Train and validation token streams held in memory, with seeded random windows."""

    train: torch.Tensor
    val: torch.Tensor
    seq_len: int
    vocab_size: int = CHAR_VOCAB

    @classmethod
    def from_config(cls, cfg: DataSpec, *, seq_len: int) -> Dataset:
        """The dataset of a text or tokens `cfg` (load_data; a job's engines use data_for)."""
        return load_data(cfg, seq_len=seq_len)

    @classmethod
    def from_ids(
        cls, ids: np.ndarray, *, vocab_size: int, seq_len: int, val_fraction: float, what: str
    ) -> TextData:
        codes = torch.from_numpy(ids)
        n_val = max(int(len(codes) * val_fraction), seq_len + 2)
        if len(codes) - n_val < seq_len + 2:
            raise SpecError(
                f"{what} has {len(codes)} tokens: too few for model.seq_len {seq_len} with "
                f"data.val_fraction {val_fraction} (needs at least {n_val + seq_len + 2})"
            )
        return cls(train=codes[:-n_val], val=codes[-n_val:], seq_len=seq_len, vocab_size=vocab_size)

    def batch(
        self, *, split: str, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs idx_BT, targets_BT) as int64, drawn at offsets from `generator`."""
        source = self.train if split == "train" else self.val
        hi = len(source) - self.seq_len - 1
        starts = torch.randint(0, hi, (batch_size,), generator=generator)
        rows = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = source[rows].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


# ---- tokens (memmap) ----------------------------------------------------------------------------


def _scan_max(mm: np.ndarray) -> int:
    """The largest id in a memmap, read in fixed chunks so host memory stays flat."""
    top = 0
    for i in range(0, len(mm), _SCAN_CHUNK):
        top = max(top, int(mm[i : i + _SCAN_CHUNK].max()))
    return top


@dataclass(slots=True)
class TokenFiles:
    """nanoGPT-style train.bin / val.bin: flat token ids, read through memory maps. A batch copies
    only its own windows (batch_size x (seq_len + 1) ids), never the file."""

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    vocab_size: int

    @classmethod
    def open(cls, cfg: DataSpec, *, seq_len: int) -> TokenFiles:
        folder = resolve_path(cfg.path or "", field="data.path")
        if not folder.is_dir():
            raise SpecError(f"data.path: {folder} is not a folder (it must hold train.bin and val.bin)")
        dtype = np.dtype(cfg.dtype)
        maps = {}
        for split in ("train", "val"):
            f = folder / f"{split}.bin"
            if not f.is_file():
                raise SpecError(f"data.path: {f} does not exist")
            size = f.stat().st_size
            if size % dtype.itemsize:
                raise SpecError(
                    f"data.path: {f} is {size} bytes, not a whole number of {cfg.dtype} tokens "
                    f"(is data.dtype right?)"
                )
            if size // dtype.itemsize < seq_len + 2:
                raise SpecError(
                    f"data.path: {f} holds {size // dtype.itemsize} tokens; model.seq_len {seq_len} "
                    f"needs at least {seq_len + 2}"
                )
            maps[split] = np.memmap(f, dtype=dtype, mode="r")
        vocab = cfg.vocab_size
        if vocab is None:
            vocab = max(_scan_max(maps["train"]), _scan_max(maps["val"])) + 1
        return cls(train=maps["train"], val=maps["val"], seq_len=seq_len, vocab_size=vocab)

    def batch(
        self, *, split: str, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        source = self.train if split == "train" else self.val
        hi = len(source) - self.seq_len - 1
        starts = torch.randint(0, hi, (batch_size,), generator=generator).tolist()
        window = np.stack([source[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        if self.vocab_size and window.max() >= self.vocab_size:
            raise SpecError(
                f"data: token id {int(window.max())} in {split}.bin is >= data.vocab_size ({self.vocab_size})"
            )
        t = torch.from_numpy(window)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


# ---- python -------------------------------------------------------------------------------------


_VAL_POOL = 64  # validation batches kept, so every evaluation scores the same set


@dataclass(slots=True)
class PythonData:
    """Batches from the user's (train, val) iterables. Training batches come in the iterable's own
    order (restarted when exhausted; a resumed run starts it again); validation draws from the
    first few val batches with the evaluation's own generator, so every evaluation sees the same set."""

    train_source: Iterable[Any]
    val_source: Iterable[Any]
    batch_size: int
    vocab_size: int
    _train_it: Iterator[Any] | None = None
    _val_pool: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def _checked(self, item: Any, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if not (
            isinstance(item, tuple | list)
            and len(item) == 2
            and all(isinstance(t, torch.Tensor) for t in item)
        ):
            raise UserCodeError(
                f"data.entry: a {split} batch must be a pair (inputs, targets) of tensors, got {type(item).__name__}"
            )
        x, y = item
        if x.shape[0] != self.batch_size:
            raise UserCodeError(
                f"data.entry: a {split} batch has {x.shape[0]} rows but train.batch_size is {self.batch_size}"
            )
        return x, y

    def _next_train(self) -> Any:
        if self._train_it is None:
            self._train_it = iter(self.train_source)
        try:
            return next(self._train_it)
        except StopIteration:
            self._train_it = iter(self.train_source)
            try:
                return next(self._train_it)
            except StopIteration:
                raise UserCodeError("data.entry: the train iterable is empty") from None

    def batch(
        self, *, split: str, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if split == "train":
            return self._checked(self._next_train(), split)
        if not self._val_pool:
            self._val_pool = [self._checked(b, "val") for b in itertools.islice(self.val_source, _VAL_POOL)]
            if not self._val_pool:
                raise UserCodeError("data.entry: the val iterable is empty")
        pick = int(torch.randint(0, len(self._val_pool), (1,), generator=generator))
        return self._val_pool[pick]


def open_python(cfg: DataSpec, *, batch_size: int, seq_len: int, seed: int) -> PythonData:
    fn = load_entry(cfg.entry or "", field="data.entry")
    out = call_entry(fn, field="data.entry", batch_size=batch_size, seq_len=seq_len, seed=seed, **cfg.args)
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise UserCodeError(
            f"data.entry must return (train, val) iterables of batches, got {type(out).__name__}"
        )
    if cfg.vocab_size is None:
        vocab = 0  # not token data (e.g. images): only a python model can consume it
    else:
        vocab = cfg.vocab_size
    return PythonData(train_source=out[0], val_source=out[1], batch_size=batch_size, vocab_size=vocab)


# ---- the entry point the engines use ------------------------------------------------------------


def load_data(cfg: DataSpec, *, seq_len: int, batch_size: int = 0, seed: int = 0) -> Dataset:
    """The dataset `cfg` names. Bad paths, empty files and unreadable tokenizers raise SpecError
    naming the field."""
    if cfg.kind == "tokens":
        return TokenFiles.open(cfg, seq_len=seq_len)
    if cfg.kind == "python":
        return open_python(cfg, batch_size=batch_size, seq_len=seq_len, seed=seed)
    from trainer.workspace import workspace

    if cfg.path is None and cfg.tokenizer == "char":
        ids, vocab = load_corpus(cfg.max_chars), CHAR_VOCAB
    else:
        ids, vocab = _load_text(cfg.path or "", cfg.tokenizer, cfg.max_chars, str(workspace()))
    return TextData.from_ids(
        ids,
        vocab_size=vocab,
        seq_len=seq_len,
        val_fraction=cfg.val_fraction,
        what=f"data.path {cfg.path or 'stdlib'}",
    )


_OPEN: dict[tuple[Any, ...], Dataset] = {}


def data_for(job: JobSpec) -> Dataset:
    """The job's dataset, opened once per process for the file kinds (the runner's vocabulary
    check and the engine share it, so tokenizing and vocabulary scans run once)."""
    from trainer.workspace import workspace

    key = (repr(job.data), job.model.seq_len, job.train.batch_size, job.train.seed, str(workspace()))
    if job.data.kind == "python":
        # iterables carry state: every run (and every trial of a selection) starts its own
        return load_data(
            job.data, seq_len=job.model.seq_len, batch_size=job.train.batch_size, seed=job.train.seed
        )
    if key not in _OPEN:
        _OPEN.clear()
        _OPEN[key] = load_data(
            job.data, seq_len=job.model.seq_len, batch_size=job.train.batch_size, seed=job.train.seed
        )
    return _OPEN[key]


def with_data_vocab(job: JobSpec) -> JobSpec:
    """The job with model.vocab_size following the data (a built-in model's embedding and head are
    sized by it; a python model's entry point gets it when it takes `vocab_size`); refused when
    the data holds ids the model cannot embed."""
    data = data_for(job)
    if not data.vocab_size:
        if job.model.kind == "python":
            return job  # not token data (e.g. images): the user's recipe knows its inputs
        raise SpecError(
            f"data.vocab_size is required for data.kind {job.data.kind} with the built-in model "
            f"{job.model.kind} (it sizes the embedding)"
        )
    problem = vocab_problem(model_vocab=job.model.vocab_size, data_vocab=data.vocab_size)
    if problem:
        raise SpecError(problem)
    vocab = job.model.vocab_size or data.vocab_size
    return job.model_copy(update={"model": job.model.model_copy(update={"vocab_size": vocab})})


@dataclass(slots=True)
class BatchStream:
    """Training batch for step k depends on (seed, k) only, so a resumed run or a parallel run
    that draws step k's batch sees the same data as an uninterrupted single-device run."""

    data: Dataset
    batch_size: int
    seed: int

    def batch_for(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self.data.batch(split="train", batch_size=self.batch_size, generator=g)
