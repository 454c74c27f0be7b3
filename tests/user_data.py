"""A user's data module for the workspace tests: `batches` streams token windows of a periodic
sequence, so a model learns it fast and its loss falls."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tests.archives import targz, upload

PERIODIC_BATCHES_PY = b"""
import torch

def batches(*, batch_size, seq_len, seed, period):
    def stream(offset):
        g = torch.Generator().manual_seed(seed + offset)
        while True:
            starts = torch.randint(0, period, (batch_size, 1), generator=g)
            w = (starts + torch.arange(seq_len + 1)) % period
            yield w[:, :-1], w[:, 1:]
    return stream(0), stream(1)
"""

# PERIODIC_BATCHES_PY's windows, held mid-run for as long as a test wants: from batch `hold_at` of
# the training stream on, each batch waits while the file `gate` exists, then sleeps `pause`. A
# test creates the gate before it submits, does what must land while the job runs (a kill, a
# restart, a cut stream), and deletes the gate to let the run go on. It holds whatever the
# machine's speed: a run made "long enough" by its step count had finished before the fault on a
# fast idle machine, and a timed margin can run out on a loaded one.
HELD_BATCHES_PY = b"""
import os
import time

import torch

def batches(*, batch_size, seq_len, seed, period, gate, hold_at, pause=0.0):
    def stream(offset):
        g = torch.Generator().manual_seed(seed + offset)
        n = 0
        while True:
            n += 1
            if offset == 0 and n >= hold_at:
                while os.path.exists(gate):
                    time.sleep(0.02)
                time.sleep(pause)
            starts = torch.randint(0, period, (batch_size, 1), generator=g)
            w = (starts + torch.arange(seq_len + 1)) % period
            yield w[:, :-1], w[:, 1:]
    return stream(0), stream(1)
"""


def held_data(ws: str, gate: Path, *, hold_at: int, pause: float = 0.0) -> dict:
    """The `data` and `workspace` of a spec that trains on HELD_BATCHES_PY (uploaded as workspace
    `ws`, module `held`): held from batch `hold_at` while the file `gate` exists."""
    return {
        "workspace": ws,
        "data": {
            "kind": "python",
            "entry": "held:batches",
            "args": {"period": 13, "gate": str(gate), "hold_at": hold_at, "pause": pause},
            "vocab_size": 13,
        },
    }


def upload_held(handle: Any) -> str:
    """Upload HELD_BATCHES_PY as a workspace (module `held`) with the client of `handle` (a
    StackHandle); its ref."""
    resp = upload(handle, targz({"held.py": HELD_BATCHES_PY}), name="held")
    assert resp.status_code == 201, resp.text
    return resp.json()["ref"]


def let_go_when_asked(gate: Path, stop: Path, timeout: float = 120) -> threading.Thread:
    """On a thread of its own (started, returned): delete `gate` once `stop` exists, the stop file
    the worker writes to ask the job's trainer to stop at its next step (warm shutdown,
    preemption, cancel), or after `timeout` s whatever happened (the test's own checks then
    fail). A held trainer reaches no step boundary, so it is let go only once asked: let go
    earlier, it could run to its end first."""

    def wait() -> None:
        deadline = time.monotonic() + timeout
        while not stop.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        gate.unlink(missing_ok=True)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t
