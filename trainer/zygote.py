"""`python -m trainer.zygote --fd N`: the warm trainer, a process that has imported torch and the
trainer once and forks one single-process run at a time when its worker asks (workers/warm.py).

The worker sends, over the SOCK_SEQPACKET socket whose end is fd N, one JSON request
{"cmd": [python, "-m", "trainer" | "trainer.selection", ...], "env": {...}, "cwd": ...} with three
file descriptors: the run's stdout and stderr (write ends of the worker's pipes) and the read end
of a "go" pipe. The zygote forks twice: the middle process forks the run and exits, so the run is
re-parented to the worker (the zygote's parent, a child subreaper) and the worker waits for it like
any child of its own. The zygote replies {"pid": run} once that has happened; the worker then sets
the run's memory limit and writes one byte to the go pipe, and the run starts. A worker that gives
up before (a timeout) closes the go pipe and the run leaves without doing anything.

The run is its own process, exactly as `python -m trainer` would be: its own session (the stop
watcher kills its group), SIGKILL when the worker dies (PR_SET_PDEATHSIG, set once it is the
worker's child), its own RLIMIT_AS, the worker's environment and working directory, stdout and
stderr on the worker's pipes, `python -m trainer ...` as its command line (ps, /proc), and the
module run as `__main__` (runpy, as `-m` does). What it shares with the zygote is only what
importing left behind. The zygote itself never runs a torch operation and never touches CUDA (no
thread pools, no device context exist when it forks); the one difference a forked run keeps is the
zygote's PYTHONHASHSEED (string hashing), which nothing the trainer computes depends on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import random
import resource
import runpy
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

RUNNABLE = ("trainer", "trainer.selection")
"""The modules a run may be: `python -m trainer` and `python -m trainer.selection`."""
PR_SET_PDEATHSIG = 1
WARM_MARK = "warm trainer: this run was forked from zygote"
SPARE_MARK = "warm trainer: this run's sandbox and imports were made before the job came"
"""The first stderr line of a forked run (the job's stderr.log says how its trainer started)."""
SPARE_STARTED = "shardyard-spare-started"
"""The spare's first line on stdout, before its imports: its sandbox is made (workers/spare.py
STARTED_LINE; the worker may rename the folder it binds from then on)."""
SPARE_READY = "shardyard-spare-ready"
"""The spare's line on stdout once its imports are done (workers/spare.py READY_LINE)."""


def preload() -> None:
    """Everything a single-process run imports, so that a fork starts with it done."""
    import torch  # noqa: F401

    # what building the first nn.Module pulls in lazily (torch 2.13): about as long as `import torch`
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.onnx  # noqa: F401

    import trainer

    for mod in pkgutil.walk_packages(trainer.__path__, "trainer."):
        if mod.name != __name__:
            importlib.import_module(mod.name)
    import torch.profiler  # noqa: F401 - the step loop's

    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.getproctitle()  # finds the command line's memory while the environment is whole


def cuda_untouched() -> bool:
    import torch

    return not torch.cuda.is_initialized()


def serve(sock: socket.socket) -> None:
    """Fork one run per request until the worker closes its end."""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 3)
        except InterruptedError:
            continue
        if not data:
            return  # the worker is gone or shut us down
        try:
            reply = _fork_run(json.loads(data), fds, sock)
        except Exception as e:  # noqa: BLE001 - the worker falls back to a fresh process
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(reply).encode())


def _fork_run(req: dict[str, Any], fds: list[int], sock: socket.socket) -> dict[str, Any]:
    cmd = req.get("cmd") or []
    if len(cmd) < 3 or cmd[1] != "-m" or cmd[2] not in RUNNABLE or len(fds) != 3:
        return {"error": f"cannot run {cmd[1:3]!r} with {len(fds)} descriptors"}
    if not cuda_untouched():
        return {"error": "CUDA was initialised in the zygote; it must not fork"}
    zygote, worker = os.getpid(), os.getppid()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: fork the run, tell the zygote its pid, leave
        try:
            os.close(r)
            run = os.fork()
            if run == 0:
                os.close(w)
                _run(req, fds, sock, zygote=zygote, worker=worker)  # never returns
            os.write(w, str(run).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    os.waitpid(middle, 0)  # once it is reaped, the run is the worker's child
    if not got:
        return {"error": "the fork of the run failed"}
    return {"pid": int(got)}


def _run(req: dict[str, Any], fds: list[int], sock: socket.socket, *, zygote: int, worker: int) -> None:
    """In the run's process: become `python -m <module> <args>` and exit with its code."""

    def body() -> int:
        sock.close()
        out_w, err_w, go_r = fds
        os.setsid()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd in (out_w, err_w, null):
            os.close(fd)
        with os.fdopen(go_r, "rb") as go:
            if go.read(1) != b"g":
                os._exit(0)  # the worker gave up on this run before it started
        _die_with_worker(worker)
        return _become(req, f"{WARM_MARK} {zygote} (torch imported once)")

    _exit_with(body)


def _exit_with(body: Callable[[], int]) -> NoReturn:
    """Run `body` and leave this process with its code (1 with its trace on stderr if it raised):
    a run never returns into the zygote's code."""
    code = 70
    try:
        code = body()
    except BaseException:  # noqa: BLE001 - the trace goes to the run's stderr, the worker sees the code
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _become(req: dict[str, Any], mark: str) -> int:
    """Become `python -m <module> <args>` of `req` in this process; returns its exit code."""
    os.write(2, f"{mark}\n".encode())
    cmd = req["cmd"]
    _set_title(req.get("title") or cmd)  # before the environment changes: it takes its space
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the process's own
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    random.seed()  # a fresh process seeds from the OS; so does this one
    sys.argv = cmd[2:]  # runpy puts the module's path first, as `python -m` does
    # preload imported the package's __main__ under its own name, which `-m` never does (runpy
    # would warn that it was in sys.modules before it ran)
    sys.modules.pop(f"{cmd[2]}.__main__", None)
    try:
        runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
    except SystemExit as e:  # the module's own exit (and argparse's usage errors)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return 0


def spare() -> NoReturn:
    """`--spare`: the sandboxed warm start (workers/spare.py). Import, say so on stdout, read the
    one run's request from stdin, put its memory limit on this process before any of the job's
    code runs, and become that run."""

    def body() -> int:
        os.write(1, f"{SPARE_STARTED}\n".encode())
        preload()
        os.write(1, f"{SPARE_READY}\n".encode())
        line = sys.stdin.buffer.readline()
        if not line:
            return 0  # the worker discarded this spare
        req = json.loads(line)
        cmd = req.get("cmd") or []
        if len(cmd) < 3 or cmd[1] != "-m" or cmd[2] not in RUNNABLE:
            raise ValueError(f"cannot run {cmd[1:3]!r}")
        if not cuda_untouched():
            raise RuntimeError("CUDA was initialised before the run")
        if (limit := req.get("memory_limit")) is not None:
            resource.setrlimit(resource.RLIMIT_AS, (int(limit), int(limit)))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        return _become(req, SPARE_MARK)

    _exit_with(body)


def _die_with_worker(worker_pid: int) -> None:
    """SIGKILL when the worker dies; the run must be the worker's child by now (else it leaves)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != worker_pid:
        os._exit(70)


def _set_title(cmd: list[str]) -> None:
    """The run's command line reads as the one a fresh process would have (ps, /proc/PID/cmdline)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(cmd))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.zygote", description=__doc__)
    ap.add_argument("--fd", type=int, help="this end of the worker's SEQPACKET socket")
    ap.add_argument("--spare", action="store_true", help="one run, in a sandbox made ahead (stdin)")
    args = ap.parse_args(argv)
    if args.spare:
        spare()  # never returns
    if args.fd is None:
        ap.error("--fd or --spare is required")
    sock = socket.socket(fileno=args.fd)
    preload()
    sock.send(b'{"ready": true}')
    serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
