"""A checkpoint's model weights as a safetensors file, streamed, without torch (api/ never imports
it): the trainer's checkpoint is torch's zip format (a pickle that names each tensor's storage,
dtype, offset, shape and stride, and one zip member of raw bytes per storage), so the "model"
entry's tensors are found by a restricted unpickler that builds nothing but plain containers and
tensor descriptions (any other object in the pickle becomes an inert stand-in, never called), and
their bytes are copied from the zip members into safetensors' layout: an 8-byte little-endian
header length, a JSON header ({name: {dtype, shape, data_offsets}}), then the tensors' bytes.
`safetensors.torch.load_file` reads the result (tests/integration/test_weights_download.py)."""

from __future__ import annotations

import json
import math
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

CHUNK = 1 << 20

# torch's storage classes in a checkpoint's pickle -> (safetensors dtype, bytes per element)
_STORAGES = {
    "DoubleStorage": ("F64", 8),
    "FloatStorage": ("F32", 4),
    "HalfStorage": ("F16", 2),
    "BFloat16Storage": ("BF16", 2),
    "LongStorage": ("I64", 8),
    "IntStorage": ("I32", 4),
    "ShortStorage": ("I16", 2),
    "CharStorage": ("I8", 1),
    "ByteStorage": ("U8", 1),
    "BoolStorage": ("BOOL", 1),
}


class NotWeights(ValueError):
    """The checkpoint holds no weights safetensors can carry; the message says why."""


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: str
    itemsize: int


@dataclass(frozen=True, slots=True)
class _Storage:
    kind: _StorageType
    key: str


@dataclass(frozen=True, slots=True)
class _Tensor:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.storage.kind.itemsize

    def contiguous(self) -> bool:
        want, step = [], 1
        for n in reversed(self.shape):
            want.append(step)
            step *= n
        return all(n == 1 or s == w for n, s, w in zip(self.shape, self.stride, reversed(want), strict=True))


class _Inert:
    """Whatever else the pickle holds (the optimizer's and the loop's objects): accepted, kept
    inert, never run."""

    def __new__(cls, *_a: Any, **_k: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *_a: Any, **_k: Any) -> None:
        pass

    def __setstate__(self, _state: Any) -> None:
        pass


def _rebuild_tensor(storage: _Storage, offset: int, shape: Any, stride: Any, *_rest: Any) -> _Tensor:
    return _Tensor(storage=storage, offset=int(offset), shape=tuple(shape), stride=tuple(stride))


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


class _Reader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGES:
            return _StorageType(*_STORAGES[name])
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        return type(name, (_Inert,), {})

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise NotWeights(f"the checkpoint's pickle names an unknown stored object ({str(pid)[:80]})")
        kind = pid[1]
        if not isinstance(kind, _StorageType):
            raise NotWeights(f"the checkpoint holds tensors of a kind safetensors cannot carry ({kind!r})")
        return _Storage(kind=kind, key=str(pid[2]))


@dataclass(frozen=True, slots=True)
class SafetensorsPlan:
    """What the safetensors file of one checkpoint holds: its header bytes (length prefix
    included) and each tensor's source, in the file's order."""

    head: bytes
    tensors: list[tuple[str, _Tensor]]
    prefix: str
    """The checkpoint zip's folder (`archive/`) of data.pkl and data/<key>."""

    @property
    def size(self) -> int:
        return len(self.head) + sum(t.nbytes for _, t in self.tensors)


def plan(fh: IO[bytes], *, metadata: dict[str, str]) -> SafetensorsPlan:
    """Read the checkpoint's pickle from `fh` (a seekable file) and lay out its "model" tensors.
    NotWeights with the reason when it holds none, or ones safetensors cannot carry."""
    try:
        zf = zipfile.ZipFile(fh)
    except zipfile.BadZipFile as e:
        raise NotWeights(f"the checkpoint is not torch's zip format: {e}") from e
    pkl = next((n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") == 1), None)
    if pkl is None:
        raise NotWeights("the checkpoint has no data.pkl")
    with zf.open(pkl) as f:
        state = _Reader(f).load()
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict) or not model:
        raise NotWeights('the checkpoint holds no model weights (no "model" entry of tensors)')
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    tensors: list[tuple[str, _Tensor]] = []
    at = 0
    for name, t in model.items():
        if not isinstance(t, _Tensor):
            raise NotWeights(f"the checkpoint's model entry {str(name)[:80]!r} is not a tensor")
        if not t.contiguous():
            raise NotWeights(f"tensor {name!r} is not contiguous in the checkpoint")
        header[str(name)] = {
            "dtype": t.storage.kind.dtype,
            "shape": list(t.shape),
            "data_offsets": [at, at + t.nbytes],
        }
        tensors.append((str(name), t))
        at += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors' bytes start 8-byte aligned
    return SafetensorsPlan(
        head=struct.pack("<Q", len(text)) + text, tensors=tensors, prefix=pkl[: -len("data.pkl")]
    )


def stream(fh: IO[bytes], laid: SafetensorsPlan) -> Iterator[bytes]:
    """The safetensors file's bytes in chunks, copied from the checkpoint's zip members; `fh` is
    closed at the end."""
    try:
        yield laid.head
        zf = zipfile.ZipFile(fh)
        for _, t in laid.tensors:
            with zf.open(f"{laid.prefix}data/{t.storage.key}") as member:
                skip, left = t.offset * t.storage.kind.itemsize, t.nbytes
                while skip:
                    skip -= len(member.read(min(skip, CHUNK)))
                while left:
                    block = member.read(min(left, CHUNK))
                    if not block:
                        raise NotWeights(
                            f"the checkpoint's storage {t.storage.key} is shorter than its tensors"
                        )
                    left -= len(block)
                    yield block
    finally:
        fh.close()
