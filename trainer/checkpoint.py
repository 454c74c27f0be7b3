"""Checkpoints: one file per saved step, written atomically, the newest intact one found by name.

A checkpoint is first written to a hidden temporary file in the same folder, flushed to the disk
(fsync), then renamed over its final name and the folder entry flushed too: a crash or a full disk
at any point leaves either the complete file or none, never a partial one under a checkpoint's
name. A file that is damaged anyway (truncated by a copy, corrupted on disk) fails the zip CRC check
and is never loaded: the loader takes the newest intact one and renames the bad one aside.

After each save only the newest `keep` checkpoints stay (SHARDYARD_CHECKPOINT_KEEP, default 3; 0
keeps all), and never one a resume may still need: every checkpoint from the newest at or below
the step the database has applied on (the worker writes that step into the folder's `applied-step`
file, jobrules/applied.py; all of them while none is at or below it). So a relay that lags any
number of checkpoints behind the trainer never leaves an attempt that dies with nothing to resume
from. Without the file (a trainer run by hand) the count alone decides. The temporary files of
writers that died mid-write (kill -9, OOM) are removed once they are stale: their process is gone
and the file has not changed for STALE_TMP_S.
"""

from __future__ import annotations

import errno
import os
import pickle
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from jobrules.applied import APPLIED_FILE, kept_steps, read_applied_step

_PREFIX = "step-"
_SUFFIX = ".pt"
KEEP_ENV = "SHARDYARD_CHECKPOINT_KEEP"
DEFAULT_KEEP = 3
STALE_TMP_S = 600.0
"""A temporary file untouched this long whose writer is not a live process here was left by a
writer that died. The age matters as much as the process: a folder shared between nodes holds
temporaries of writers this node cannot see, and a live writer touches its file as it writes."""


class CheckpointError(RuntimeError):
    pass


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written for a reason of the filesystem (errno): a full disk
    (ENOSPC), a quota (EDQUOT), a file-size limit (EFBIG), an I/O error."""

    def __init__(self, message: str, *, errno_: int) -> None:
        super().__init__(message)
        self.errno = errno_


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"{_PREFIX}{step:08d}{_SUFFIX}"


def keep_from_env() -> int:
    raw = os.environ.get(KEEP_ENV, "")
    try:
        return max(0, int(raw)) if raw.strip() else DEFAULT_KEEP
    except ValueError:
        return DEFAULT_KEEP


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    directory: Path,
    *,
    step: int,
    state: dict[str, Any],
    keep: int | None = None,
    applied_file: Path | None = None,
) -> Path:
    """Write `state` (plus the step) as the checkpoint of `step`, atomically, then prune to the
    newest `keep` (None: SHARDYARD_CHECKPOINT_KEEP) and those from the applied step on (read from
    `applied_file`, by default the folder's own; a rank's piece of a pipeline or tensor layout
    passes its job folder's). A write the filesystem refuses (a full disk:
    ENOSPC) raises CheckpointWriteError naming the cause, the path and the free bytes, after the
    temporary file is removed; no checkpoint of that step exists then."""
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, step)
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save({"step": step, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        written = _size(tmp)
        tmp.unlink(missing_ok=True)
        if (cause := _filesystem_errno(e)) is not None:
            raise _write_error(path, errno_=cause, written=written, error=e) from e
        raise
    _fsync_dir(directory)
    prune_checkpoints(directory, keep=keep_from_env() if keep is None else keep, applied_file=applied_file)
    remove_stale_temporaries(directory)
    return path


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _filesystem_errno(e: BaseException) -> int | None:
    """The errno of the OSError behind `e`. torch's zip writer turns a failed write of the file
    object into its own RuntimeError ("[enforce fail at inline_container.cc] unexpected pos"),
    with the OSError (ENOSPC) only as its context, so the chain is searched."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur.errno
        cur = cur.__cause__ or cur.__context__
    return None


def _write_error(path: Path, *, errno_: int, written: int, error: BaseException) -> CheckpointWriteError:
    try:
        st = os.statvfs(path.parent)
        free = f"{st.f_bavail * st.f_frsize:,} bytes are free there"
    except OSError:
        free = "its free space could not be read"
    what = os.strerror(errno_)
    if errno_ in (errno.ENOSPC, errno.EDQUOT):
        # the partial file is already gone: what is free now is what the next write would get
        detail = f"the write stopped after {written:,} bytes; {free} (the partial file removed)"
    else:
        detail = f"{type(error).__name__}: {error}"
    return CheckpointWriteError(f"{what}: checkpoint {path} could not be written: {detail}", errno_=errno_)


def _alive(pid: int) -> bool:
    """A process with this pid exists here (another user's too: that raises PermissionError)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale_temporaries(directory: Path, *, older_than_s: float = STALE_TMP_S) -> list[Path]:
    """Remove `.step-*.pt.<pid>.tmp` files left by writers that died mid-write: their pid is not a
    live process and they have not changed for `older_than_s`. Returns what was removed."""
    removed = []
    now = time.time()
    for tmp in directory.glob(f".{_PREFIX}*{_SUFFIX}.*.tmp"):
        try:
            pid = int(tmp.name.rsplit(".", 2)[-2])
            stale = now - tmp.stat().st_mtime > older_than_s
        except (ValueError, OSError):
            continue
        if pid != os.getpid() and stale and not _alive(pid):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _by_step(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints oldest first, by the step number: the names are zero-padded
    to 8 digits only, so past 99,999,999 their order is not the steps' (and pruning would remove
    the newest). Names that do not parse are left out."""
    steps = []
    for path in directory.glob(f"{_PREFIX}*{_SUFFIX}"):
        try:
            steps.append((int(path.name[len(_PREFIX) : -len(_SUFFIX)]), path))
        except ValueError:
            continue
    return sorted(steps)


def prune_checkpoints(directory: Path, *, keep: int, applied_file: Path | None = None) -> list[Path]:
    """Remove all but the checkpoints `kept_steps` (jobrules/applied.py) leaves (0 keeps all), the applied step read from
    `applied_file` (default: the folder's `applied-step`; missing: the count alone); returns what
    was removed."""
    if keep <= 0 or not directory.is_dir():
        return []
    applied = read_applied_step(applied_file or directory / APPLIED_FILE)
    found = _by_step(directory)
    kept = kept_steps([s for s, _ in found], keep=keep, applied=applied)
    old = [path for s, path in found if s not in kept]
    for p in old:
        p.unlink(missing_ok=True)
    return old


def is_intact(path: Path) -> bool:
    """A torch checkpoint is a zip archive: complete (its central directory is at the end) and
    every member's CRC matches. Reads the file once; far cheaper than a failed resume."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return False


def latest_checkpoint(directory: Path | None) -> Path | None:
    """The newest intact checkpoint in `directory`, or None. Damaged ones on the way are renamed
    to `*.corrupt` (kept for inspection, never tried again) and reported on stderr."""
    if directory is None or not directory.is_dir():
        return None
    for _, path in reversed(_by_step(directory)):
        if is_intact(path):
            return path
        set_aside(path, "is damaged (incomplete or failed its CRC check)")
    return None


def checkpoint_steps(directory: Path | None) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in `directory` by its name, newest first (not checked)."""
    if directory is None or not directory.is_dir():
        return []
    return _by_step(directory)[::-1]


def set_aside(path: Path, why: str) -> None:
    """Rename a checkpoint that cannot be loaded to `*.corrupt`, reported on stderr (another
    process that shares the folder may have done it first)."""
    aside = path.with_name(path.name + ".corrupt")
    print(f"checkpoint {path} {why}; moved to {aside.name}", file=sys.stderr)
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        pass


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The state saved at `path`; CheckpointError naming the file when it cannot be read."""
    if not is_intact(path):
        raise CheckpointError(f"checkpoint {path} is damaged (incomplete or failed its CRC check)")
    try:
        # weights and plain containers only: a checkpoint folder is written by the job's own
        # (untrusted) code, and a pickled callable in it must not run in the next attempt
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {e}") from e
