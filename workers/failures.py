"""Why a trainer attempt failed, in words that name the cause, and whether a new attempt may help.

A rank killed by a signal (the kernel's OOM killer sends SIGKILL; so does an operator's kill -9)
takes its process group's sockets with it, so the surviving ranks fail too, with gloo's
"Connection closed by peer" or NCCL's timeout. That survivor's error is what the trainer's error
line says; the cause is in torchrun's failure summary on stderr (every failed local rank with its
exit code, negative for a signal: torch/distributed/elastic/multiprocessing/errors), or, for a
one-process trainer, in its own negative exit code. This module reads those and names the rank.

Whether the kernel's OOM killer sent the SIGKILL is best-effort: the memory cgroup's oom_kill
counter (cgroup v2 memory.events, or v1 memory.oom_control) rising during the attempt, or a
"Killed process <pid>" line in the kernel log (/dev/kmsg, readable by root or with
kernel.dmesg_restrict=0 only). Where neither can be read the message names the signal alone.

Retry policy (like Celery's and Determined's): a failure of the infrastructure (a rank killed by
a signal, a worker lost) is retried from the checkpoint up to the spec's max_restarts; a failure
of the job itself (its code raised, a NaN loss, a bad spec, a limit it ran past) is not: it would
fail again the same way.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from dataclasses import dataclass, replace
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")

JOB_OWN_FAILURES = (
    "bad spec",
    "ran past its max_runtime_s",
    "user code failed",
    "TrainingError",
    "CheckpointWriteError",
    "environment",
)
"""How the trainer's error line (trainer/__main__.py) starts when a new attempt would fail the same
way: a spec it refused, a limit, the user's code, a NaN or infinite loss (trainer/loop.py
check_finite), a checkpoint the storage refused (full), the job's own requirements that
workers/pyenv.py could not install. A gang retries other errors, since one node
often sees only that a peer's sockets closed."""

# one entry of torchrun's summary (errors/__init__.py _FAILURE_FORMAT_TEMPLATE)
_ENTRY = re.compile(
    r"host\s*:\s*(?P<host>\S+)\s*\n"
    r"\s*rank\s*:\s*(?P<rank>\d+) \(local_rank: (?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+) \(pid: (?P<pid>\d+)\)"
)
# the agent's own log line, printed before the summary (api.py "failed (exitcode: ...)")
_AGENT_LINE = re.compile(
    r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<local>\d+) \(pid: (?P<pid>\d+)\)"
)


@dataclass(frozen=True, slots=True)
class RankDeath:
    """A trainer process that ended by a signal."""

    rank: int | None
    """Global rank (None: the trainer ran as one process, or only the local rank is known)."""
    pid: int
    signum: int
    host: str | None = None
    oom: str | None = None
    """How the kernel said its OOM killer was involved ("kernel log", "cgroup"), None: no sign."""

    def describe(self) -> str:
        try:
            name = signal.Signals(self.signum).name
        except ValueError:
            name = f"signal {self.signum}"
        who = f"rank {self.rank}" if self.rank is not None else "the trainer"
        who += f" (pid {self.pid})" if self.pid else ""
        where = f" on {self.host}" if self.host and self.host != "localhost" else ""
        text = f"{who}{where} was killed by {name} (exit code {-self.signum})"
        if self.oom == "kernel log":
            text += ", by the kernel's OOM killer (the kernel log says so): the node ran out of memory"
        elif self.oom == "cgroup":
            text += (
                "; the kernel's OOM killer killed a process of this worker's memory cgroup during the "
                "attempt (its oom_kill count rose), most likely this one"
            )
        return text


def signal_deaths(*, rc: int, stderr: str) -> list[RankDeath]:
    """The trainer processes that died by a signal, the first observed first: from torchrun's
    failure summary, else its agent's log lines, else the trainer's own exit code (one process).
    Ranks that exited with an error code are left out (the survivors, or the job's own failure).
    SIGTERM counts only when no rank failed otherwise: torchrun itself sends it to stop the other
    ranks once one failed, and a rank that raised is the job's own failure."""
    summary = stderr[stderr.rfind("Failures:") :] if "Failures:" in stderr else stderr
    root_at = summary.find("Root Cause")
    found: dict[int, RankDeath] = {}
    errors = 0
    for m in sorted(_ENTRY.finditer(summary), key=lambda m: m.start() < root_at):
        code, pid = int(m["code"]), int(m["pid"])
        if code < 0:
            found[pid] = RankDeath(rank=int(m["rank"]), pid=pid, signum=-code, host=m["host"])
        else:
            errors += 1
    if not found and not errors:
        for m in _AGENT_LINE.finditer(stderr):
            code, pid = int(m["code"]), int(m["pid"])
            if code < 0:
                # only the local rank is on this line; with one node it is the global rank too
                found[pid] = RankDeath(rank=int(m["local"]), pid=pid, signum=-code)
            else:
                errors += 1
    if not found and not errors and rc < 0:
        return [RankDeath(rank=None, pid=0, signum=-rc)]
    killed = [d for d in found.values() if d.signum != signal.SIGTERM]
    return killed or ([] if errors else list(found.values()))


def _memory_cgroup_files() -> list[Path]:
    """This process's memory cgroup counter files (v2 memory.events, v1 memory.oom_control); the
    trainer runs in the worker's cgroup. A container may show its cgroup at the mount's root
    rather than under the path /proc/self/cgroup names, so the root is tried too."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            bases = [_CGROUP_ROOT, _CGROUP_ROOT / "unified"]
            name = "memory.events"
        elif "memory" in controllers.split(","):
            bases, name = [_CGROUP_ROOT / "memory"], "memory.oom_control"
        else:
            continue
        for base in bases:
            for candidate in (base / rel / name, base / name):
                if candidate.is_file() and candidate not in found:
                    found.append(candidate)
                    break
    return found


def oom_kill_count() -> int | None:
    """The kernel's OOM-kill count of this process's memory cgroup, or None where unreadable."""
    total = None
    for path in _memory_cgroup_files():
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    total = (total or 0) + int(value)
        except (OSError, ValueError):
            continue
    return total


def kernel_says_oom_killed(pids: set[int]) -> set[int]:
    """Which of `pids` the kernel log says its OOM killer killed ("Killed process <pid> (...)").
    Reads /dev/kmsg without blocking; an empty set where it is not readable."""
    if not pids:
        return set()
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return set()
    killed: set[int] = set()
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:  # a record was overwritten while reading: read on
                    continue
                break
            if not record:
                break
            m = re.search(r"Killed process (\d+) ", record)
            if m and int(m[1]) in pids:
                killed.add(int(m[1]))
    finally:
        os.close(fd)
    return killed


def infrastructure_failure(*, rc: int, stderr: str, oom_before: int | None) -> str | None:
    """The reason, when the attempt failed for the infrastructure (a trainer process killed by a
    signal its worker did not send: the caller checks that), or None when the failure is the
    job's own (its error line stands then, and no new attempt is made).
    `oom_before`: the cgroup's OOM-kill count when the attempt started (oom_kill_count)."""
    deaths = signal_deaths(rc=rc, stderr=stderr)
    if not deaths:
        return None
    after = oom_kill_count()
    rose = oom_before is not None and after is not None and after > oom_before
    by_kernel = kernel_says_oom_killed({d.pid for d in deaths if d.pid})

    def oom_sign(d: RankDeath) -> str | None:
        if d.signum != signal.SIGKILL:  # the OOM killer sends SIGKILL only
            return None
        return "kernel log" if d.pid in by_kernel else "cgroup" if rose else None

    named = [replace(d, oom=oom_sign(d)) for d in deaths]
    # the other ranks' errors (gloo's "Connection closed by peer") follow from these deaths; they
    # stay in the job's events, not in its reason
    return "; ".join(d.describe() for d in named)
