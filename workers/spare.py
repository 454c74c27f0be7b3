"""The sandboxed warm start: a trainer process started ahead of its job, inside a sandbox of its own.

A fork of the warm trainer (workers/warm.py) cannot enter bubblewrap, and one zygote forking every
job's run would put them all in one sandbox, where they could see each other. So each worker pool
process keeps one *spare* instead: a fresh bubblewrap sandbox, made exactly as a cold run's
(workers/sandbox.py), around a `python -m trainer.zygote --spare` that has imported torch and the
trainer and waits, on its stdin, for the one run it will become. The sandbox binds a folder of its
own read-write (`jobs/.spare-*` in the data dir, mode 0700) and nothing else of the data dir, with
an empty `workspace/` in it read-only: a job's workspace is unpacked below it once the folder is
the job's (`workspace/tree`, one rename), so users' code stays read-only as in a cold run.

When a job that fits comes (one process of the worker's Python with no environment of its own to
bind, no network: `misfit`), the worker *adopts* the spare before the attempt writes anything: whatever the job's
folder already held (an earlier attempt's checkpoints) moves into the spare's folder, and the
spare's folder is renamed to the job's (the sandbox's bind follows the directory, not its name).
From then on it is the job's folder on the host. Inside the sandbox it keeps the spare's path, so
the run's command line and environment name that path instead (`translate`), and a symlink from
the spare's old name to the job's folder lets the host resolve a path the trainer reports. The run
gets its command, environment and memory limit as one JSON line, sets the limit on itself before
any of the job's code runs, and becomes `python -m trainer ...`. The spare is used once. The next
one is started when the job has ended (`replenish`), so its imports never compete with a run on
the CPU, whose threads use its share of the cores (workers/cores.py); for a run whose compute is on a GPU it is started as soon
as the run took this one (`ahead`, Settings.spare_ahead), so a job right after it starts warm.

Supervision is unchanged: the spare's bubblewrap process is the run's process (its own session,
its pipes, its exit code, SIGKILL when the worker dies). A spare that died, is not ready in time or
answers wrongly is killed and the run starts cold in a new sandbox, in the same folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from core.settings import Settings
from workers.sandbox import Sandbox, apply_limits, die_with_parent, sandbox_limits

log = logging.getLogger(__name__)

PREFIX = ".spare-"
"""A spare's folder in the data dir's jobs/ (no job's: jobs' folders are named by their ids)."""
STARTED_LINE = "shardyard-spare-started"
"""What the spare prints on its stdout first, before its imports: its sandbox is made."""
READY_LINE = "shardyard-spare-ready"
"""What the spare prints on its stdout once its imports are done."""
BOUND_TIMEOUT_S = 30.0
"""How long a run that takes the spare waits for its sandbox to be made; after it, cold."""
READY_TIMEOUT_S = 120.0
"""How long a run waits for its spare's imports (a loaded machine is slow); after it, cold."""
RUNNABLE = ("trainer", "trainer.selection")
WORKSPACE, TREE = "workspace", "tree"
"""A spare's read-only placeholder for the workspace, and the folder a workspace unpacks to in it
(workers/workspace.py unpack_workspace)."""


def unpacked_workspace(folder: Path) -> Path:
    """Where a run's workspace is unpacked in its `folder`: `workspace/`, or `workspace/tree` in a
    folder a spare was adopted as (below the sandbox's read-only placeholder)."""
    tree = folder / WORKSPACE / TREE
    return tree if tree.is_dir() else folder / WORKSPACE


class Spare:
    """One sandboxed trainer started ahead of its run (one use)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        jobs = settings.data_dir / "jobs"
        jobs.mkdir(parents=True, exist_ok=True)
        self.inside = jobs / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.inside.mkdir(mode=0o700)
        # a job's workspace is unpacked below this folder once adopted (workers/workspace.py):
        # read-only in the sandbox, as a cold run's workspace is
        (self.inside / WORKSPACE).mkdir()
        self.sandbox = Sandbox(
            settings=settings, read_write=[self.inside], read_only=[self.inside / WORKSPACE], user_code=True
        )
        self.adopted: Path | None = None
        self._lines_seen = 0  # of STARTED_LINE, READY_LINE
        self._pending = b""  # read from its stdout, not yet a whole line
        self.why_not = ""
        """Why wait_bound or wait_ready said no (set when one does)."""
        self.started = False
        limits = sandbox_limits(self.sandbox)

        def preexec() -> None:
            die_with_parent()
            apply_limits(limits)

        cmd = self.sandbox.command([sys.executable, "-m", "trainer.zygote", "--spare"])
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=self.sandbox.environment(),
            preexec_fn=preexec,  # noqa: PLW1509 - only setsid, prctl and setrlimit
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_bound(self, timeout: float) -> bool:
        """Whether the sandbox has bound the spare's folder (its started line: bubblewrap makes
        every mount before it runs Python) within `timeout` seconds. Its folder may be renamed
        (adopted) only then: a rename before would leave bubblewrap no source to bind."""
        return self._wait_for(STARTED_LINE, timeout)

    def wait_ready(self, timeout: float) -> bool:
        """Whether the spare finished its imports (its ready line) within `timeout` seconds; when
        not, `why_not` says what it did instead."""
        return self._wait_for(READY_LINE, timeout)

    def _wait_for(self, want: str, timeout: float) -> bool:
        """Reads the spare's lines (started, then ready) until `want` has come. Read from the pipe
        itself, never through the text wrapper, whose buffer would hold a line select cannot see
        (and that the run's protocol, read through it after the start, must not find)."""
        order = (STARTED_LINE, READY_LINE)
        if self._lines_seen > order.index(want):
            return True
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while self.alive():
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                text = line.decode(errors="replace").strip()
                due = order[self._lines_seen] if self._lines_seen < len(order) else "nothing"
                if text != due:
                    self.why_not = f"it printed {text[:200]!r} where {due!r} was due"
                    return False
                self._lines_seen += 1
                if self._lines_seen > order.index(want):
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                self.why_not = f"it had not printed {want!r} within {timeout:g} s"
                return False
            got, _, _ = select.select([fd], [], [], min(left, 1.0))
            if got:
                chunk = os.read(fd, 4096)
                if not chunk:  # its stdout closed: it is ending
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=min(max(left, 0.1), 5.0))
                    break
                self._pending += chunk
        code = self.proc.poll()
        how = "it closed its stdout" if code is None else f"it exited with code {code}"
        self.why_not = f"{how}: {self._stderr_tail()}"
        return False

    def _stderr_tail(self) -> str:
        """The end of what a spare that exited wrote on its stderr (none read before)."""
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        os.set_blocking(fd, False)  # a process of the sandbox may still hold the pipe open
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        text = b"".join(chunks).decode(errors="replace").strip()
        return text[-500:] or "nothing on its stderr"

    def adopt(self, folder: Path, *, move_existing: bool) -> None:
        """Make the spare's folder the run's `folder` (before the attempt writes into it). A job's
        folder that exists (an earlier attempt's checkpoints and logs) moves into it first
        (`move_existing`: only one attempt of a job runs at a time); a selection's folder, which
        its other groups may be using, must not exist yet. Raises OSError when it cannot."""
        if folder.is_dir() and move_existing:
            for entry in folder.iterdir():
                if entry.name == WORKSPACE and not entry.is_symlink():  # an earlier attempt's
                    # unpacked workspace: below the placeholder (its read-only mount point), never
                    # over it (a link of that name, left by a trainer, moves as any name does)
                    tree = entry / TREE
                    if tree.is_symlink():  # a trainer's leftover, never followed
                        tree.unlink()
                    (tree if tree.is_dir() else entry).rename(self.inside / WORKSPACE / TREE)
                    if entry.exists():
                        shutil.rmtree(entry)
                else:
                    entry.rename(self.inside / entry.name)
            folder.rmdir()
        folder.parent.mkdir(parents=True, exist_ok=True)
        _rename_noreplace(self.inside, folder)  # never over a folder another run just made
        self.inside.symlink_to(folder)  # a path the trainer reports still resolves on the host
        self.adopted = folder

    def misfit(self, cmd: list[str], sandbox: Sandbox) -> str | None:
        """Why `cmd` in `sandbox` is not the run this spare can become, or None when it is: a
        single-process trainer in a sandbox that binds the adopted folder alone (what a workspace
        or an environment of the job's own adds cannot be bound into a sandbox already made)."""
        if self.adopted is None:
            return "its folder was not adopted"
        if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m" or cmd[2] not in RUNNABLE:
            return f"{' '.join(cmd[:3])} is no single-process trainer"
        if not sandbox.wraps or sandbox.network:
            return "the run's sandbox differs (no bubblewrap, or the host's network)"
        if sandbox.read_write != [self.adopted]:
            return f"the run's folders {sandbox.read_write} are not its {self.adopted}"
        if extra := [p for p in sandbox.read_only if p.exists() and p != self.adopted / WORKSPACE]:
            return f"the run binds {extra} too"
        return None

    def translate(self, text: str) -> str:
        """`text` with the adopted folder's path as the sandbox sees it (the spare's)."""
        assert self.adopted is not None
        outside, inside = str(self.adopted), str(self.inside)
        if text == outside or text.startswith(outside + "/"):
            return inside + text[len(outside) :]
        return text

    def start(
        self, cmd: list[str], *, env: dict[str, str], memory_limit: int | None
    ) -> subprocess.Popen[str]:
        """The spare becomes `cmd`; returns its process (the run's). Raises when it cannot."""
        if not self.wait_ready(READY_TIMEOUT_S):
            raise ConnectionError(f"the spare trainer was not ready: {self.why_not}")
        assert self.proc.stdin is not None
        req = {
            "cmd": [self.translate(a) for a in cmd],
            # ps and /proc/PID/cmdline show the run as the host names it (its job's folder)
            "title": cmd,
            "env": {k: self.translate(v) for k, v in env.items()},
            "cwd": str(self.inside),
            "memory_limit": memory_limit,
        }
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.close()
        self.started = True
        return self.proc

    def discard(self) -> None:
        """Kill the spare (unused, or failed) and remove what is its own."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
        self.release()

    def release(self) -> None:
        """After its run: the folder is the job's; only the symlink is the spare's."""
        if self.adopted is None:
            shutil.rmtree(self.inside, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.inside.unlink()


class _Pool:
    """This worker pool process's spare (none in a process that never started one)."""

    def __init__(self) -> None:
        self.spare: Spare | None = None
        self.on = False
        self.lock = threading.Lock()


_POOL = _Pool()


def prestart(settings: Settings) -> bool:
    """Start this pool process's spare (its start), where runs are sandboxed and warm runs are on.
    False when it does not apply (the warm zygote serves instead)."""
    probe_sandbox = Sandbox(settings=settings, read_write=[])
    if not (settings.warm_trainer and probe_sandbox.wraps):
        return False
    with _POOL.lock:
        _POOL.on = True
        _sweep(settings)
        _start(settings)
    return True


def _start(settings: Settings) -> None:
    if _POOL.spare is not None and _POOL.spare.alive() and _POOL.spare.adopted is None:
        return
    try:
        _POOL.spare = Spare(settings)
    except Exception as e:  # noqa: BLE001 - runs start cold; the next job's end tries again
        log.warning("could not start a spare sandboxed trainer: %s", e)
        _POOL.spare = None


GPU_NODES = "/dev/nvidia[0-9]*"
"""The device nodes of a host's NVIDIA GPUs (what a run asking for any device trains on, when there)."""


def ahead(settings: Settings, *, gpus: int, device: str) -> bool:
    """Whether a run that took this pool process's spare has the next one started at once
    (Settings.spare_ahead): `gpus` it holds, the `device` its spec asks for."""
    if settings.spare_ahead != "auto":
        return settings.spare_ahead == "always"
    # a worker shown no GPU (CUDA_VISIBLE_DEVICES empty, or from an invalid index on) runs on the CPU
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() in ("", "-1")
    return gpus > 0 or (device != "cpu" and not hidden and bool(glob.glob(GPU_NODES)))


def take(
    settings: Settings, folder: Path, *, fits: bool, move_existing: bool = True, start_next: bool = False
) -> Spare | None:
    """The spare, adopted as `folder` (Spare.adopt), for a run that `fits` it: one process of the
    worker's own Python, with no workspace to bind (None: the run starts cold). `start_next`
    (`ahead`): the pool's next spare is started now, not when the run has ended."""
    if not fits:
        return None
    with _POOL.lock:
        spare, _POOL.spare = _POOL.spare, None
        if spare is not None and start_next and _POOL.on:
            _start(settings)
    if spare is None:
        return None
    if not spare.wait_bound(BOUND_TIMEOUT_S):  # a spare started just now (the last run's end)
        log.warning(
            "the spare sandboxed trainer cannot be used (%s); this run starts a fresh one", spare.why_not
        )
        spare.discard()
        return None
    try:
        spare.adopt(folder, move_existing=move_existing)
    except OSError as e:
        log.warning("could not adopt the spare trainer's folder as %s: %s", folder, e)
        spare.discard()
        return None
    return spare


def replenish(settings: Settings, used: Spare | None) -> None:
    """After a run: its spare's leftovers go, and this pool process starts its next spare."""
    if used is not None:
        if used.started:
            used.release()  # its process was the run's, waited for by supervision
        else:
            used.discard()  # adopted but never started (the run went cold or never launched)
    if _POOL.on:
        with _POOL.lock:
            _start(settings)


def shutdown() -> None:
    with _POOL.lock:
        if _POOL.spare is not None:
            _POOL.spare.discard()
        _POOL.spare, _POOL.on = None, False


def _sweep(settings: Settings) -> None:
    """Spares' folders and links left by pool processes that died (their pid is gone)."""
    jobs = settings.data_dir / "jobs"
    for p in jobs.glob(f"{PREFIX}*"):
        pid = p.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if p.is_symlink():
                p.unlink(missing_ok=True)
            else:
                shutil.rmtree(p, ignore_errors=True)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails (FileExistsError) instead of replacing an existing `dst`."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(dst))
