"""Users' own Python requirements: the environment a job's `env.pip` and its workspace's
requirements.txt ask for, built once per worker host with uv and reused by every later job, trial
group and node with the same requirements.

Layered, never replacing: the requirements are resolved against the worker's own interpreter with
every distribution it has installed (torch, numpy, the project's dependencies) pinned as a
constraint, so a requirement that needs another torch fails resolution with uv's reason; only the
packages the worker lacks are then installed (`--no-deps --target`) into the environment's folder,
which the trainer appends to its import path (`python -m trainer --pyenv DIR`: after the fork, for
the warm trainer too). The worker's own packages come first on the path, so they are the ones that
run.

Content-addressed: the folder is named by the sha256 of the normalised requirements and the platform
(interpreter, machine and the worker's installed versions; jobrules/pyenv.py). A build runs under an
exclusive flock of that name (a second job with the same requirements waits for it and reuses it),
into a temporary folder renamed into place once complete, made read-only and fingerprinted by its
content (every file's bytes): one that was changed is not used by the next job, which finds the
fingerprint wrong and rebuilds. Jobs never write it: the worker builds it outside any sandbox, and
the sandbox (workers/sandbox.py) mounts it read-only. Jobs using an environment hold a shared flock on it; the least
recently used environments nobody holds are deleted once the cache passes `pyenv_cache_mb`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from core.settings import Settings
from jobrules.pyenv import (
    Requirement,
    accepted,
    installed_versions,
    requirement_lines,
    requirement_problems,
    requirements_digest,
)
from jobrules.spec import JobSpec
from workers.sandbox import allowed_environment
from workers.spare import unpacked_workspace

log = logging.getLogger(__name__)

REQUIREMENTS_FILE = "requirements.txt"
MARKER = "env.json"
SITE = "site"
MAX_LOG_LINES = 300
"""Installer lines copied into the job's logs (the error is always kept whole)."""


class EnvError(Exception):
    """The job's environment cannot be had; the message is the job's error."""


@dataclass(slots=True)
class Report:
    """Where a build tells what it does: the job's log lines, its status note, and its cancel."""

    say: Callable[[str], None]
    note: Callable[[str | None], None] = lambda _note: None
    cancelled: Callable[[], bool] = lambda: False


@dataclass(slots=True)
class PreparedEnv:
    """The job's environment (none when it asks for nothing), held (a shared lock) until release."""

    path: Path | None = None
    error: str | None = None
    _lock: IO[bytes] | None = field(default=None, repr=False)

    @property
    def args(self) -> list[str]:
        """The trainer's arguments for it."""
        return [] if self.path is None else ["--pyenv", str(self.path)]

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


# ---- what the job asks for ---------------------------------------------------------------------


def requirement_sources(spec: JobSpec, *, workspace: Path | None) -> list[tuple[str, str]]:
    """(where, line) of every requirement of the job: `env.pip` then the workspace's
    requirements.txt."""
    pip = spec.requirements
    lines = [(f"env.pip[{i}]", str(x)) for i, x in enumerate(pip)]
    if workspace is not None and (workspace / REQUIREMENTS_FILE).is_file():
        text = (workspace / REQUIREMENTS_FILE).read_text(errors="replace")
        lines += [(f"requirements.txt line {n}", line) for n, line in requirement_lines(text)]
    return lines


@functools.cache
def platform_tag() -> str:
    """What an environment is built for: interpreter, machine, and the worker's own packages (a
    worker with another torch builds its own)."""
    stack = hashlib.sha256(json.dumps(sorted(installed_versions().items())).encode()).hexdigest()[:16]
    return f"{sys.implementation.cache_tag}-{platform.machine()}-{stack}"


# ---- the cache -----------------------------------------------------------------------------------


def _size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def fingerprint(site: Path) -> str:
    """The environment's content: every entry's path, type and mode, each file's bytes and each
    link's target. Any change to it changes this, whoever made it and whatever times it forged
    (a path, size and mtime fingerprint is one the same uid can restore by hand)."""
    h = hashlib.sha256()
    for p in sorted(site.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(site)}\0{st.st_mode}\0".encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode())
        elif stat.S_ISREG(st.st_mode):
            with p.open("rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        h.update(b"\n")
    return h.hexdigest()


def _read_only(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _remove(path: Path) -> None:
    """Delete a (read-only) environment folder: moved aside first, so no one sees half of it."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    path.rename(trash)
    for p in [trash, *trash.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)
    shutil.rmtree(trash, ignore_errors=True)


def _ready(dest: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def evict(root: Path, *, cap_bytes: int, keep: str) -> list[str]:
    """Delete least recently used environments (not `keep`, none that a job builds or uses) until
    the cache fits `cap_bytes`. Returns the names deleted."""
    envs = []
    for d in root.iterdir():
        if d.name.startswith(".") or not d.is_dir() or (marker := _ready(d)) is None:
            continue
        used = root / f"{d.name}.used"
        envs.append((used.stat().st_mtime if used.exists() else 0.0, d, int(marker.get("bytes", 0))))
    total = sum(b for _, _, b in envs)
    gone = []
    for _, d, nbytes in sorted(envs, key=lambda e: e[0]):
        if total <= cap_bytes:
            break
        if d.name == keep:
            continue
        with open(root / f"{d.name}.lock", "ab") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a job uses it or builds it
            _remove(d)
            (root / f"{d.name}.used").unlink(missing_ok=True)
        total -= nbytes
        gone.append(d.name)
    return gone


# ---- building --------------------------------------------------------------------------------


def _index_args(settings: Settings) -> list[str]:
    args = ["--no-config", "--link-mode", "copy", "--cache-dir", str(settings.pyenv_root / ".uv-cache")]
    if settings.pyenv_index_url:
        args += ["--default-index", settings.pyenv_index_url]
    if settings.pyenv_find_links:
        args += ["--find-links", settings.pyenv_find_links]
    if settings.pyenv_no_index:
        args.append("--no-index")
    return args


def uv_bin() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


def _run(
    cmd: list[str], *, cwd: Path, deadline: float, limit_s: float, report: Report, out: list[str]
) -> int:
    """Run the installer, its lines into `out` and (the first MAX_LOG_LINES) the job's logs; killed
    at `deadline` or on a cancel (EnvError)."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
        # a source distribution runs its own code while it builds: it gets none of the worker's
        # credentials (the allow-listed variables only, workers/sandbox.py)
        env={**allowed_environment(build=True), "NO_COLOR": "1", "HOME": str(cwd)},
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line.rstrip())
            if len(out) <= MAX_LOG_LINES:
                report.say(f"uv: {line.rstrip()}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise EnvError(
                        f"environment build took longer than the {limit_s:.0f} s limit "
                        "(SHARDYARD_PYENV_BUILD_TIMEOUT_S)"
                    ) from None
                if report.cancelled():
                    raise EnvError("cancelled while preparing its environment") from None
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    return rc


def _uv_error(lines: list[str]) -> str:
    """uv's own error (it names the package and the conflict), without its hints' noise."""
    start = next((i for i, line in enumerate(lines) if line.startswith(("error:", "×"))), None)
    picked = lines[start:] if start is not None else lines[-8:]
    text = " ".join(" ".join(line.split()) for line in picked if line.strip())
    return text[:2000]


_PLAN = re.compile(r"^\s*([+-])\s+(\S.*?)\s*$")


def build(reqs: list[Requirement], *, settings: Settings, tmp: Path, report: Report, deadline: float) -> None:
    """Resolve `reqs` over the worker's own packages and install what it lacks into tmp/site."""
    limit = settings.pyenv_build_timeout_s
    tmp.mkdir(parents=True)
    (tmp / "requirements.in").write_text("".join(f"{r.text}\n" for r in reqs))
    (tmp / "constraints.txt").write_text(
        "".join(f"{n}=={v}\n" for n, v in sorted(installed_versions().items()))
    )
    uv, common = uv_bin(), _index_args(settings)
    lines: list[str] = []
    # resolved against this very interpreter: what it has installed satisfies the requirements it
    # can, and the constraints forbid changing any of it. A dry run changes nothing, so a system
    # interpreter marked externally managed (Debian's) may be asked too
    plan_cmd = [uv, "pip", "install", "--dry-run", "--break-system-packages", "--python", sys.executable]
    plan_cmd += ["-r", "requirements.in"]
    plan_cmd += ["-c", "constraints.txt", *common]
    rc = _run(plan_cmd, cwd=tmp, deadline=deadline, limit_s=limit, report=report, out=lines)
    if rc != 0:
        raise EnvError(f"resolving the requirements failed: {_uv_error(lines)}")
    plan = [m.groups() for line in lines if (m := _PLAN.match(line))]
    if removed := [what for sign, what in plan if sign == "-"]:
        raise EnvError(f"the requirements would replace the worker's own packages: {', '.join(removed)}")
    pins = [what for sign, what in plan if sign == "+"]
    site = tmp / SITE
    site.mkdir()
    if pins:
        lines.clear()
        install_cmd = [uv, "pip", "install", "--no-deps", "--python", sys.executable, "--target", str(site)]
        if options := [r.text for r in reqs if r.option and r.text.startswith("-")]:
            # what an admin allowed (an index, find-links) serves the install as it served the plan
            (tmp / "options.in").write_text("".join(f"{o}\n" for o in options))
            install_cmd += ["-r", "options.in"]
        install_cmd += [*common, *pins]
        rc = _run(install_cmd, cwd=tmp, deadline=deadline, limit_s=limit, report=report, out=lines)
        if rc != 0:
            raise EnvError(f"installing the requirements failed: {_uv_error(lines)}")
    nbytes = _size(site)
    if nbytes > settings.pyenv_max_mb * 2**20:
        raise EnvError(
            f"the environment is {nbytes / 2**20:.1f} MiB, more than the {settings.pyenv_max_mb:.0f} MiB "
            "allowed (SHARDYARD_PYENV_MAX_MB)"
        )
    for name in ("requirements.in", "constraints.txt", "options.in"):
        (tmp / name).unlink(missing_ok=True)
    _read_only(site)
    marker = {
        "requirements": [r.text for r in reqs],
        "installed": pins,
        "bytes": nbytes,
        "fingerprint": fingerprint(site),
        "built_at": time.time(),
        "platform": platform_tag(),
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=1))


def _lock(path: Path, *, mode: int, deadline: float, report: Report, waiting: str) -> IO[bytes]:
    f = open(path, "ab")  # noqa: SIM115 - held past this function (the caller's lock)
    try:
        fcntl.flock(f, mode | fcntl.LOCK_NB)
        return f
    except BlockingIOError:
        report.note("preparing environment")  # another job's build: this one waits on it
        report.say(waiting)
    try:
        while True:
            try:
                fcntl.flock(f, mode | fcntl.LOCK_NB)
                return f
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EnvError(
                        "waited too long for another job's build of the same environment"
                    ) from None
                if report.cancelled():
                    raise EnvError("cancelled while preparing its environment") from None
                time.sleep(0.2)
    except BaseException:
        f.close()
        raise


MAX_REFUSALS_NAMED = 20


def refused_error(problems: list[str]) -> str:
    """A refused requirements.txt's error: its first MAX_REFUSALS_NAMED problems and how many
    more there are (a file of thousands of refused lines makes an error of a few lines)."""
    named = "; ".join(problems[:MAX_REFUSALS_NAMED])
    more = len(problems) - MAX_REFUSALS_NAMED
    return f"environment refused: {named}" + (f"; and {more} more problem(s)" if more > 0 else "")


def prepare(spec: JobSpec, *, settings: Settings, workspace: Path | None, report: Report) -> PreparedEnv:
    """The job's environment, built if needed and held until `release()`; `error` set (and no
    environment) when its requirements are refused or the build failed. Never raises for a job's
    fault: the caller fails the job with the error."""
    try:
        lines = requirement_sources(spec, workspace=workspace)
    except OSError as e:
        return PreparedEnv(error=f"environment: reading the workspace's requirements.txt failed: {e}")
    if not lines:
        return PreparedEnv()
    allow = settings.pyenv_allow_options
    if problems := requirement_problems(lines, installed=installed_versions(), allow_options=allow):
        return PreparedEnv(error=refused_error(problems))
    reqs = accepted(lines, allow_options=allow)
    key = requirements_digest(reqs, platform=platform_tag())
    root = settings.pyenv_root
    root.mkdir(parents=True, exist_ok=True)
    dest = root / key
    t0 = time.monotonic()
    deadline = t0 + settings.pyenv_build_timeout_s
    try:
        held = _use(dest, reqs=reqs, settings=settings, report=report, deadline=deadline)
    except EnvError as e:
        report.say(f"environment {key[:12]} failed: {e}")
        return PreparedEnv(error=f"environment: {e}")
    except Exception as e:  # noqa: BLE001 - a disk or installer fault fails this job, not the worker
        log.exception("environment %s", key)
        return PreparedEnv(error=f"environment: preparing it failed: {type(e).__name__}: {e}")
    finally:
        report.note(None)
    (root / f"{key}.used").touch()
    with contextlib.suppress(OSError):
        if gone := evict(root, cap_bytes=int(settings.pyenv_cache_mb * 2**20), keep=key):
            log.info("environment cache: evicted %s", ", ".join(g[:12] for g in gone))
    return PreparedEnv(path=dest / SITE, _lock=held)


def _use(
    dest: Path, *, reqs: list[Requirement], settings: Settings, report: Report, deadline: float
) -> IO[bytes]:
    """Hold `dest` built and intact (a shared lock); build it first under the exclusive lock."""
    key, root = dest.name, dest.parent
    lock_path = root / f"{key}.lock"
    t0 = time.monotonic()
    shared = _lock(lock_path, mode=fcntl.LOCK_SH, deadline=deadline, report=report, waiting=_waiting(key))
    if (marker := _ready(dest)) is not None and marker.get("fingerprint") == fingerprint(dest / SITE):
        report.say(
            f"environment {key[:12]}: cached ({len(reqs)} requirements, {marker['bytes'] / 2**20:.1f} MiB)"
        )
        return shared
    shared.close()
    report.note("preparing environment")
    report.say(f"preparing environment {key[:12]}: {', '.join(r.text for r in reqs)}")
    excl = _lock(lock_path, mode=fcntl.LOCK_EX, deadline=deadline, report=report, waiting=_waiting(key))
    try:
        marker = _ready(dest)
        if marker is not None and marker.get("fingerprint") == fingerprint(dest / SITE):
            report.say(f"environment {key[:12]}: built by another job, reused")
        else:
            if marker is not None or dest.exists():
                report.say(
                    f"environment {key[:12]} was changed or left incomplete since it was built: rebuilt"
                )
                _remove(dest)
            tmp = root / f".tmp-{key}-{os.getpid()}"
            _remove(tmp)
            try:
                build(reqs, settings=settings, tmp=tmp, report=report, deadline=deadline)
                tmp.rename(dest)
            finally:
                _remove(tmp)
            marker = _ready(dest) or {}
            report.say(
                f"environment {key[:12]} ready in {time.monotonic() - t0:.1f} s: installed "
                f"{', '.join(marker.get('installed') or []) or 'nothing (the worker has every package)'}; "
                f"{marker.get('bytes', 0) / 2**20:.1f} MiB"
            )
        # held on as a user: an eviction elsewhere could only take it in the instant flock
        # converts the lock, and evictions skip the environment just built in this process
        fcntl.flock(excl, fcntl.LOCK_SH)
        return excl
    except BaseException:
        excl.close()
        raise


def _waiting(key: str) -> str:
    return f"environment {key[:12]}: another job is building it; waiting"


def for_run(
    spec: JobSpec,
    *,
    settings: Settings,
    workspace: Path | None,
    relay: Any,
    keys: list[int | None],
    cancelled: Callable[[], bool],
) -> PreparedEnv:
    """prepare() for a job (keys [None]) or a selection group (its trials' keys) whose lines go
    through `relay` (workers/relay.py): the build's lines land in each one's logs, and
    `preparing environment` is each one's wait_reason while it builds."""
    from core.messages import Message
    from db.connection import session_for
    from db.jobs import set_run_note

    def say(text: str) -> None:
        for k in keys:
            relay.add(k, Message(kind="log", message=text))

    def note(text: str | None) -> None:
        try:
            with session_for(settings.database_url) as s:
                set_run_note(s, attempts=[relay.targets[k].attempt for k in keys], note=text)
                s.commit()
        except Exception as e:  # noqa: BLE001 - a note is for people; the build goes on
            log.warning("could not note %r on the job: %s", text, e)

    return prepare(
        spec, settings=settings, workspace=workspace, report=Report(say=say, note=note, cancelled=cancelled)
    )


def for_job(spec: JobSpec, *, settings: Settings, workdir: Path, relay: Any, job_id: int) -> PreparedEnv:
    """for_run() for one job's attempt (or one node's, workers/gang.py) in `workdir`."""
    from db.connection import session_for
    from db.jobs import cancel_requested

    def cancelled() -> bool:
        with session_for(settings.database_url) as s:
            return cancel_requested(s, job_id=job_id)

    workspace = unpacked_workspace(workdir) if spec.workspace else None  # workers/workspace.py
    return for_run(
        spec, settings=settings, workspace=workspace, relay=relay, keys=[None], cancelled=cancelled
    )


def for_group(spec: JobSpec, *, settings: Settings, root: Path, relay: Any, keys: list[int]) -> PreparedEnv:
    """for_run() for a selection group whose base is `spec` and folder `root` (workers/selection.py)."""
    from db.connection import session_for
    from db.selections import stop_requests

    selection_id = relay.selection_id

    def cancelled() -> bool:
        with session_for(settings.database_url) as s:
            return stop_requests(s, selection_id=selection_id)[0]

    workspace = unpacked_workspace(root) if spec.workspace else None  # workers/workspace.py
    return for_run(spec, settings=settings, workspace=workspace, relay=relay, keys=keys, cancelled=cancelled)


def without_trainer(relay: Any) -> int | None:
    """The run's exit code when its environment failed and no trainer ran: 1 once the build's lines
    are applied, None when the attempt was lost meanwhile (as run_attempt answers)."""
    return 1 if relay.close() and not relay.fenced else None
