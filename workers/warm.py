"""The warm trainer: one long-lived process per worker pool process that has imported torch and the
trainer once (trainer/zygote.py) and forks each single-process run (`python -m trainer`, `python -m
trainer.selection`) when supervision asks, so a run starts in milliseconds instead of seconds.

Each run is still a process of its own and this process's child (the zygote's middle fork exits,
and this process is a child subreaper), so supervision treats it as it treats a fresh one
(workers/supervise.py): its stdout lines and stderr come over pipes, the stop watcher kills its
session, its RLIMIT_AS is its own, it dies with this process, and `waitpid` gives its exit code.
A memory limit or a kill ends the run, never the zygote; the zygote dies with this process.

Multi-rank jobs (torchrun) are not warm. On a machine with NVIDIA devices the forked run initialises
CUDA itself, which is safe because the zygote's imports leave CUDA untouched (checked on an H100:
tests/trainer/test_gpu_paths.py; the zygote refuses to fork if CUDA ever was initialised in it).
`SHARDYARD_WARM_TRAINER=false` turns this off; any failure
of the zygote (it cannot start, died, answers wrongly or late) runs that one trainer as a fresh
process and starts a new zygote for the next.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from core.settings import get_settings
from workers.limits import apply_memory_limit
from workers.sandbox import allowed_environment, die_with_parent

log = logging.getLogger(__name__)

RUNNABLE = ("trainer", "trainer.selection")
"""`python -m <one of these>` runs warm (the list trainer/zygote.py accepts; workers/ never imports
trainer/, tests/unit/test_boundaries.py)."""
PR_SET_CHILD_SUBREAPER = 36
READY_TIMEOUT_S = 300.0
"""The first run waits this long for the zygote's imports (a loaded machine is slow); after it,
that run goes cold."""
REPLY_TIMEOUT_S = 30.0
"""How long one fork may take before the run goes cold instead."""


class WarmProcess:
    """The part of subprocess.Popen that supervision uses, for a run the zygote forked: it is this
    process's child, so wait/poll are plain waitpid."""

    def __init__(self, pid: int, stdout: IO[str], stderr: IO[str]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reap(self, flags: int) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:  # reaped elsewhere: its code is lost, report a kill
                    self.returncode = -signal.SIGKILL
                    return self.returncode
                if pid != 0:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        rc = self._reap(0)
        assert rc is not None
        return rc


class Zygote:
    """This process's warm trainer; one request at a time (the lock)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.ready = False
        self.owner = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the zygote (imports run in the background; the first request waits for them)."""
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER failed")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.zygote", "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                # the runs it forks inherit its memory and its /proc/<pid>/environ: nothing of the
                # worker's credentials (workers/sandbox.py)
                env=allowed_environment(),
                preexec_fn=die_with_parent,  # noqa: PLW1509 - only setsid and prctl
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.sock, self.ready, self.owner = mine, False, os.getpid()

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc is not None and self.proc.poll() is None

    def ensure(self) -> None:
        """A running zygote of this process's own (a new one if it died or was inherited)."""
        if not self.alive():
            self.stop()
            self.start()

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None and self.owner == os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc, self.sock, self.ready = None, None, False

    def _recv(self, timeout: float) -> dict:
        assert self.sock is not None
        self.sock.settimeout(timeout)
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the zygote closed its socket")
        return json.loads(data)

    def spawn(self, cmd: list[str], *, env: dict[str, str], memory_limit: int | None) -> WarmProcess:
        """Fork `cmd` (python -m trainer[.selection] ...) from the zygote; raises on any failure."""
        with self._lock:
            self.ensure()
            if not self.ready:
                if self._recv(READY_TIMEOUT_S).get("ready") is not True:
                    raise ConnectionError("the zygote did not say it was ready")
                self.ready = True
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            go_r, go_w = os.pipe()
            keep = [out_r, err_r]
            try:
                req = {"cmd": cmd, "env": env, "cwd": str(Path.cwd())}
                assert self.sock is not None
                socket.send_fds(self.sock, [json.dumps(req).encode()], [out_w, err_w, go_r])
                for fd in (out_w, err_w, go_r):
                    os.close(fd)
                out_w = err_w = go_r = -1
                reply = self._recv(REPLY_TIMEOUT_S)
                if "pid" not in reply:
                    raise ConnectionError(f"the zygote refused: {reply.get('error')}")
                pid = int(reply["pid"])
                apply_memory_limit(memory_limit, pid=pid)  # the run is our child now: limit it,
                os.write(go_w, b"g")  # then let it start
                keep = []
                return WarmProcess(
                    pid,
                    stdout=open(out_r, encoding="utf-8", errors="replace"),  # noqa: SIM115
                    stderr=open(err_r, encoding="utf-8", errors="replace"),  # noqa: SIM115
                )
            finally:
                os.close(go_w)  # without the byte, a forked run leaves without running
                for fd in (out_w, err_w, go_r, *keep):
                    if fd >= 0:
                        os.close(fd)


_ZYGOTE = Zygote()


def enabled() -> bool:
    """Warm runs are on (`warm_trainer`)."""
    return get_settings().warm_trainer


def runs_warm(cmd: list[str]) -> bool:
    """Whether `cmd` is a single-process trainer run the zygote can fork, and warm runs are on."""
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] in RUNNABLE and enabled()


def launch(cmd: list[str], *, env: dict[str, str], memory_limit: int | None) -> WarmProcess | None:
    """`cmd` forked from this process's zygote, or None when it must run as a fresh process (not
    a single-process trainer run, warm runs off, or the zygote failed: then a new one is started
    for the next run)."""
    if not runs_warm(cmd):
        return None
    try:
        return _ZYGOTE.spawn(cmd, env=env, memory_limit=memory_limit)
    except Exception as e:  # noqa: BLE001 - this run goes cold, the next gets a new zygote
        log.warning("warm trainer failed (%s: %s); this run starts a fresh process", type(e).__name__, e)
        with _ZYGOTE._lock:
            _ZYGOTE.stop()
        return None


def prestart() -> None:
    """Start this process's zygote now (a pool process's start), so its first run is warm too;
    none where warm runs are off."""
    if not enabled():
        return
    with _ZYGOTE._lock:
        try:
            _ZYGOTE.ensure()
        except Exception as e:  # noqa: BLE001 - runs go cold and retry the start
            log.warning("could not start the warm trainer: %s", e)


def shutdown() -> None:
    """Stop this process's zygote and stop adopting orphans (for processes that are no worker)."""
    with _ZYGOTE._lock:
        _ZYGOTE.stop()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 0)


def reap_group(pgid: int, *, wait_s: float = 2.0) -> None:
    """Reap this process's children left in a killed run's process group: as a child subreaper it
    adopts whatever a run leaves orphaned (torchrun's ranks when torchrun died first), and nobody
    else waits for them."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return  # none left in that group
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
