"""How the trainer talks to whoever runs it, without knowing who that is.

The worker launches `python -m trainer` (or torchrun) and reads one JSON object per line from the
stdout the trainer was started with, which the trainer keeps for these lines alone
(`protocol_channel`: users' prints go to stderr, the job's log):

    {"seq": 0, "kind": "metric", "step": 12, "name": "loss", "value": 3.91, "time": 1732.1}
    {"seq": 1, "kind": "log", "message": "...", "time": ...}
    {"seq": 2, "kind": "event", "event": "checkpoint", "data": {"step": 12, ...}, "time": ...}
    {"seq": 3, "kind": "result", "data": {...}, "time": ...}

`seq` grows by one per line of this process: the worker applies each line at most once (it reads
the format with core/messages.py). Only rank 0 writes. The worker asks the trainer to stop by creating the stop file; the trainer
checks it once per step (all ranks agree on the answer, see `should_stop`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO


class MetricsSink(Protocol):
    def metric(self, step: int, name: str, value: float) -> None: ...

    def log(self, message: str) -> None: ...

    def event(self, event: str, data: dict[str, Any]) -> None: ...

    def result(self, data: dict[str, Any]) -> None: ...


class StopSignal(Protocol):
    def requested(self) -> bool: ...


def protocol_channel() -> TextIO:
    """The protocol's own channel: the stdout this process was started with, taken before any
    users' code loads, while fd 1 (and with it `print`, C libraries, subprocesses) is pointed at
    stderr. Whatever users' code prints, with or without a newline, JSON or not, then lands in the
    job's log and never among the protocol lines the worker reads (it changes no metric and no
    status). Every rank takes it, so what any rank prints is a log line of that rank."""
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    return open(fd, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 - the process's own, to its end


class ProtocolLines:
    """A MetricsSink that makes each call one protocol line, the object a subclass's `write` writes."""

    def write(self, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def metric(self, step: int, name: str, value: float) -> None:
        self.write({"kind": "metric", "step": step, "name": name, "value": float(value)})

    def log(self, message: str) -> None:
        self.write({"kind": "log", "message": message})

    def event(self, event: str, data: dict[str, Any]) -> None:
        self.write({"kind": "event", "event": event, "data": data})

    def result(self, data: dict[str, Any]) -> None:
        self.write({"kind": "result", "data": data})


class JsonlSink(ProtocolLines):
    """Writes protocol lines to a text stream (stdout by default), flushing each line."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self._stream = stream or sys.stdout
        self._enabled = enabled
        self._seq = 0

    def write(self, obj: dict[str, Any]) -> None:
        if self._enabled:
            obj = {"seq": self._seq, **obj, "time": time.time()}
            self._seq += 1
            self._stream.write(json.dumps(obj, separators=(",", ":")) + "\n")
            self._stream.flush()

    def error(self, message: str) -> None:
        """Written even by non-zero ranks: the worker reports the first error it reads."""
        self._enabled = True
        self.write({"kind": "error", "message": message})


class ListSink:
    """Keeps everything in memory; for tests and benchmarks."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, str, float]] = []
        self.logs: list[str] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.results: list[dict[str, Any]] = []

    def metric(self, step: int, name: str, value: float) -> None:
        self.metrics.append((step, name, float(value)))

    def log(self, message: str) -> None:
        self.logs.append(message)

    def event(self, event: str, data: dict[str, Any]) -> None:
        self.events.append((event, data))

    def result(self, data: dict[str, Any]) -> None:
        self.results.append(data)

    def series(self, name: str) -> list[float]:
        return [v for _, n, v in self.metrics if n == name]


class NullSink(ListSink):
    """Swallows everything (non-zero ranks)."""

    def metric(self, step: int, name: str, value: float) -> None:
        pass

    def log(self, message: str) -> None:
        pass


class FileStopSignal:
    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self._path = Path(path) if path else None

    def requested(self) -> bool:
        return self._path is not None and self._path.exists()


class NeverStop:
    def requested(self) -> bool:
        return False


def should_stop(stop: StopSignal) -> bool:
    """Every rank must leave the loop at the same step, or collectives deadlock: each rank reads
    its signal and the ranks agree by a sum, so a stop asked on any node of a multi-node job (each
    node's worker has its own stop file) stops every rank at the same step."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stop.requested()
    # NCCL reduces device tensors only: the flag lives on this rank's GPU there
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([1 if stop.requested() else 0], device=device)
    # note: a collective per step; a few microseconds on gloo, negligible beside a training step
    dist.all_reduce(flag)
    return bool(flag.item())
