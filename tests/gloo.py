"""Run a function on N real processes joined in a gloo process group (the CPU stand-in for NCCL).

    results = run_ranks(my_fn, world_size=4, args=(cfg,))   # my_fn(rank, world_size, *args)

`my_fn` must be importable (a module-level function in a test module or in trainer/). Each rank's
return value comes back in rank order; an exception in any rank fails the call with that rank's
traceback. Keep models tiny: every rank shares the machine's two cores.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

# Ranks start from a fork server that imported torch and the trainer once, not from a fresh
# interpreter each (spawn): on the test machine's two cores every spawned rank spent seconds of
# CPU importing torch before its first collective. The server forks before any op has run, so no
# OpenMP or gloo thread exists in it to be lost across the fork (what makes plain fork unsafe).
_PRELOAD = ["torch", "torch.distributed", "trainer.runner", "trainer.loop"]
multiprocessing.set_forkserver_preload(_PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    # one thread per rank: N ranks on 2 cores oversubscribe badly otherwise
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pkl"
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # every rank has joined before fn runs: a rank whose fn ends at once (no collective) could
        # otherwise exit while a peer was still connecting, failing that peer inside init
        dist.barrier()
        value = fn(rank, world_size, *args)
        out.write_bytes(pickle.dumps(("ok", value)))
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # skip interpreter finalisation, as trainer/__main__.py does: gloo's static destructors
    # sometimes abort after a clean destroy, which would fail a rank that already succeeded
    os._exit(code)


def run_ranks(
    fn: Callable[..., Any], *, world_size: int, args: tuple = (), timeout_s: float = 180.0
) -> list[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), tmp, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        try:
            import time

            deadline = time.monotonic() + timeout_s
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} gloo ranks still running after {timeout_s}s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # each rank's outcome is read from its file below
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        outcomes = {}
        for rank in range(world_size):
            path = Path(tmp) / f"rank{rank}.pkl"
            if path.exists():
                outcomes[rank] = pickle.loads(path.read_bytes())
        # a rank's own error first: its peers were killed while waiting on it and left no file
        for rank, (status, value) in sorted(outcomes.items()):
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
        missing = [r for r in range(world_size) if r not in outcomes]
        if missing:
            raise RuntimeError(f"rank(s) {missing} died without a result")
        return [outcomes[r][1] for r in range(world_size)]
