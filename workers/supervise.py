"""The one supervision path for a trainer process, a job's or a selection group's: launch it in
its own session, read its stdout protocol lines (core/messages.py) into a callback, keep its
stderr, and run one stop watcher that asks it to stop (the stop file), then kills it after a
grace. It never outlives `supervise`.

Warm shutdown: SIGTERM to the pool process sets DRAIN (see workers/tasks.py); the watcher then asks
the trainer to stop and checkpoint, and kills it after `shutdown_grace_s`.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from core.messages import Message, parse_line
from core.safe_files import open_append, write_fresh
from workers.limits import apply_memory_limit
from workers.logcap import Emit, split_rank
from workers.sandbox import Sandbox, allowed_environment, apply_limits, die_with_parent, sandbox_limits
from workers.spare import Spare
from workers.warm import launch, reap_group

log = logging.getLogger(__name__)

DRAIN = threading.Event()
_DRAIN_WHY: list[str] = []


def drain(why: str) -> None:
    """Stop every trainer of this process warm (they checkpoint) and give their jobs back with
    `why` as the reason (a launcher's own: a warm shutdown, Slurm's signal)."""
    _DRAIN_WHY[:] = [why]
    DRAIN.set()


def drain_reason(default: str = "the worker shut down") -> str:
    """Why this process is draining, for the reason its jobs go back to the queue with."""
    return _DRAIN_WHY[0] if _DRAIN_WHY else default


"""Set when this worker process is shutting down warm: every trainer it runs stops and checkpoints."""


class Ask(Enum):
    """What the stop poll wants: nothing, a clean stop at the next step, or the process gone now."""

    none = 0
    stop = 1
    kill = 2


@dataclass(slots=True)
class Outcome:
    """What supervision learned besides the lines: the first error line, the stderr tail, and
    why the process was stopped or killed (None when it ended on its own)."""

    error: str | None = None
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    rank: int | None = None
    """The rank of output that names none: 0 for a single-process trainer, None under torchrun
    (its stdout is not prefixed)."""
    stopped: str | None = None
    """"stop" (asked to stop, e.g. a cancel), "drain" (warm shutdown), "kill" (fenced off or gave
    up on the database)"""

    def failure(self, rc: int) -> str:
        tail = "\n".join(list(self.stderr_tail)[-5:])
        return self.error or f"trainer exited with code {rc}" + (f": {tail}" if tail else "")


def kill_group(proc: subprocess.Popen[str], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _pump_stderr(proc: subprocess.Popen[str], path: Path, out: Outcome, on_output: Emit | None) -> None:
    assert proc.stderr is not None
    # the run's folder is its trainer's too: appended to, never through a link it left there;
    # line by line, so the file shows the run as it goes (tail -f)
    raw = open_append(path, root=path.parent)
    with io.TextIOWrapper(raw, encoding="utf-8", errors="replace", line_buffering=True) as f:
        for line in proc.stderr:
            f.write(line)
            rank, text = split_rank(line.rstrip())
            out.stderr_tail.append(text)
            if on_output is not None:
                on_output(rank if rank is not None else out.rank, "stderr", text)


def _watch(
    proc: subprocess.Popen[str],
    *,
    poll: Callable[[], Ask],
    stop_file: Path,
    grace_s: float,
    shutdown_grace_s: float,
    out: Outcome,
    done: threading.Event,
) -> None:
    """Every 0.5 s: ask `poll`; a stop touches the stop file (the trainer leaves at its next step
    boundary, checkpointing), and after the grace the process group gets SIGKILL."""
    deadline: float | None = None
    while not done.wait(0.5):
        try:
            ask = poll()
        except Exception:  # noqa: BLE001 - a locked database this tick: ask again next tick
            log.exception("stop poll failed")
            ask = Ask.none
        if DRAIN.is_set() and out.stopped is None:
            out.stopped, ask = "drain", Ask.stop
        if ask == Ask.kill:
            out.stopped = "kill"
            kill_group(proc, signal.SIGKILL)
            return
        if ask == Ask.stop and deadline is None:
            out.stopped = out.stopped or "stop"
            write_fresh(stop_file, b"", root=stop_file.parent)  # never through a link
            deadline = time.monotonic() + (shutdown_grace_s if out.stopped == "drain" else grace_s)
        if deadline is not None and time.monotonic() > deadline:
            log.warning("trainer %s did not stop within its grace: killed", proc.pid)
            kill_group(proc, signal.SIGKILL)
            return


def supervise(
    cmd: list[str],
    *,
    on_message: Callable[[Message], None],
    poll: Callable[[], Ask],
    stop_file: Path,
    stderr_log: Path,
    grace_s: float,
    shutdown_grace_s: float,
    out: Outcome,
    memory_limit: int | None = None,
    on_output: Emit | None = None,
    on_start: Callable[[int], None] | None = None,
    sandbox: Sandbox | None = None,
    spare: Spare | None = None,
) -> int:
    """Run `cmd` to its end; every stdout line goes to `on_message` in order (this thread), the
    first `error` line is kept in `out`. Returns the exit code; the process group never outlives
    this call. `memory_limit`: the process's address-space limit (workers/limits.py).
    `on_output(rank, stream, text)`, when given, gets the process's own output: stderr lines and
    stdout lines that are no protocol line (else those go to `on_message` as log lines);
    `on_start(pid)` the process (group) id once it runs. `sandbox`: where it runs
    (workers/sandbox.py); without one, as the worker's child with the allow-listed environment.
    `spare`: the sandboxed trainer made ahead for this run's folder (workers/spare.py), used when
    the run fits it and discarded when not."""
    stop_file.unlink(missing_ok=True)
    proc = _start(cmd, memory_limit=memory_limit, sandbox=sandbox, spare=spare)
    done = threading.Event()
    threads = [
        threading.Thread(target=_pump_stderr, args=(proc, stderr_log, out, on_output), daemon=True),
        threading.Thread(
            target=_watch,
            kwargs={
                "proc": proc,
                "poll": poll,
                "stop_file": stop_file,
                "grace_s": grace_s,
                "shutdown_grace_s": shutdown_grace_s,
                "out": out,
                "done": done,
            },
            daemon=True,
        ),
    ]
    for t in threads:
        t.start()
    if on_start is not None:
        on_start(proc.pid)
    try:
        _read_stdout(proc, out, on_message, on_output)
        return proc.wait()
    finally:
        done.set()
        _end_group(proc)
        for t in threads:
            t.join(timeout=5)


def _start(
    cmd: list[str], *, memory_limit: int | None, sandbox: Sandbox | None, spare: Spare | None
) -> subprocess.Popen[str]:
    """Start the trainer as this process's child in its own session. A single-process trainer
    starts warm: in its sandbox, as the spare trainer made ahead for it (workers/spare.py);
    unsandboxed, forked from this process's warm trainer (workers/warm.py), as a fork cannot enter
    bubblewrap. Else, or when that fails, it starts fresh."""
    limits = sandbox_limits(sandbox)

    def preexec() -> None:
        die_with_parent()
        apply_memory_limit(memory_limit)
        apply_limits(limits)

    env = sandbox.environment() if sandbox is not None else allowed_environment()
    warm: Any = None
    if spare is not None:
        warm = _start_spare(spare, cmd, env=env, memory_limit=memory_limit, sandbox=sandbox)
    elif sandbox is None or not sandbox.wraps:
        warm = launch(cmd, env=env, memory_limit=memory_limit)
    if sandbox is not None:
        cmd = sandbox.command(cmd)
    return warm or subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
        preexec_fn=preexec,  # noqa: PLW1509 - only setsid, prctl and setrlimit, no locks taken
    )


def _start_spare(
    spare: Spare, cmd: list[str], *, env: dict[str, str], memory_limit: int | None, sandbox: Sandbox | None
) -> subprocess.Popen[str] | None:
    """The spare sandboxed trainer started for `cmd`, or None (the spare discarded) when the run
    does not fit it or it fails to start."""
    why = "the run has no sandbox" if sandbox is None else spare.misfit(cmd, sandbox)
    try:
        if why is not None:
            raise ValueError(why)
        return spare.start(cmd, env=env, memory_limit=memory_limit)
    except (OSError, ValueError) as e:
        log.warning("the spare sandboxed trainer was not used (%s); this run starts a fresh one", e)
        spare.discard()
        return None


def _read_stdout(
    proc: subprocess.Popen[str], out: Outcome, on_message: Callable[[Message], None], on_output: Emit | None
) -> None:
    """Every stdout protocol line to `on_message` in order, the first `error` line kept in `out`;
    a plain log line goes to `on_output` instead, when given."""
    assert proc.stdout is not None
    for line in proc.stdout:
        msg = parse_line(line)
        if msg is None:
            continue
        if on_output is not None and msg.kind == "log" and msg.seq is None:
            rank, text = split_rank(line.rstrip())
            on_output(rank if rank is not None else out.rank, "stdout", text)
            continue
        if msg.kind == "error" and out.error is None:
            out.error = msg.message
        on_message(msg)


def _end_group(proc: subprocess.Popen[str]) -> None:
    """Kill the trainer if it still runs, then its process group (ranks torchrun left behind, if
    any), and reap their exits when this process adopted them (workers/warm.py)."""
    if proc.poll() is None:
        kill_group(proc, signal.SIGKILL)
        proc.wait()
    kill_group(proc, signal.SIGKILL)
    reap_group(proc.pid)


def run_unattended(
    cmd: list[str],
    workdir: Path,
    *,
    grace_s: float,
    out: Outcome,
    on_message: Callable[[Message], None],
    **kw: Any,
) -> int:
    """`supervise` with nobody asking it to stop (a bench's or a test's run): its stop file and
    stderr log in `workdir`, `grace_s` for both graces; `kw`: supervise's other arguments."""
    return supervise(
        cmd,
        on_message=on_message,
        poll=lambda: Ask.none,
        stop_file=workdir / "stop",
        stderr_log=workdir / "stderr.log",
        grace_s=grace_s,
        shutdown_grace_s=grace_s,
        out=out,
        **kw,
    )
