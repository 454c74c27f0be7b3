"""Files in a folder that users' code can write (a job's folder, a selection batch's, their
checkpoint folders), read and written by a process outside the sandbox without following a link.

The sandboxed trainer runs as the worker's uid, so any name it leaves in its folder may be a
symbolic link, and its target is only a string: it needs to exist outside the sandbox alone. A
worker that opened such a name with a plain path call would read (and upload as a checkpoint) or
write (a spec, a batch file, a log) whatever file the link names on the host. Here every path is
taken as `root` (a folder the trainer cannot replace: the sandbox's bind itself, or a folder above
it; trusted as given) plus the names below it, and each name is opened relative to the folder
opened before it with O_NOFOLLOW, so a link anywhere below `root`, as a folder or as the file, is
refused (`Refused`), and a name swapped for a link after a check cannot win: what is read or
written is the open descriptor. A file opened for reading must be a regular file (a FIFO or a
device is refused, and opened without blocking). A write goes to a new file (O_CREAT|O_EXCL under a
random name) renamed over the destination: a rename replaces a link, it never follows one.

A hard link needs no such care: making one needs its target's path inside the sandbox, and what
the sandbox sees of the host is read-only or in another mount (link(2) across mounts fails with
EXDEV), so a hard link in a job's folder can only name a file of that same folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(OSError):
    """A name below the root is a symbolic link, or not a regular file (or not a folder) where
    one was expected: nothing was read or written through it."""

    def __str__(self) -> str:
        return str(self.strerror)


def _names(path: Path, root: Path) -> list[str]:
    rel = Path(path).relative_to(root)  # ValueError: not below root (the caller's bug)
    parts = list(rel.parts)
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path}: no '.' or '..' below {root}")
    return parts


def _why(fd: int, name: str, path: Path, *, want: str) -> Refused:
    """The refusal for `name` (in the folder `fd`) that could not be opened as `want`."""
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    what = "a symbolic link" if stat.S_ISLNK(mode) else f"not a {want}"
    return Refused(errno.ELOOP if stat.S_ISLNK(mode) else errno.EINVAL, f"{path} is {what}: not followed")


def open_folder(path: Path, *, root: Path, create: bool = False) -> int:
    """The folder `path` (`root` or below it) opened, every name below `root` without following a
    link; a descriptor the caller closes. `create` makes the missing folders. Refused for a link
    or a file on the way; FileNotFoundError when one is missing."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        here = Path(root)
        for name in _names(path, root):
            here = here / name
            try:
                nfd = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                try:
                    nfd = os.open(name, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    raise
                except OSError as e:
                    raise _why(fd, name, here, want="folder") from e
            except OSError as e:  # ELOOP (a link) or ENOTDIR (a file)
                raise _why(fd, name, here, want="folder") from e
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def folder(path: Path, *, root: Path, create: bool = False) -> Iterator[Path]:
    """`path` opened as open_folder does, as a path that names that open folder
    (/proc/self/fd/N) for the duration: code that takes paths works below it, and renaming or
    replacing `path` meanwhile changes nothing for it. Only the names it then opens in it are its
    own care (a fresh name, or a rename over one, is safe)."""
    fd = open_folder(path, root=root, create=create)
    try:
        yield Path(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def open_regular(path: Path, *, root: Path) -> BinaryIO:
    """The regular file `path` (below `root`) opened for reading, without following a link on
    the way or at the file. Refused for a link or anything but a regular file (a FIFO, a device, a
    socket, a folder); FileNotFoundError when it is not there."""
    parent = open_folder(Path(path).parent, root=root)
    try:
        try:
            fd = os.open(
                Path(path).name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
            )
        except (FileNotFoundError, IsADirectoryError):
            raise
        except OSError as e:  # ELOOP: a link; ENXIO: a socket
            raise _why(parent, Path(path).name, Path(path), want="regular file") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise Refused(errno.EINVAL, f"{path} is not a regular file: not read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    finally:
        os.close(parent)


def read_regular(path: Path, *, root: Path, limit: int | None = None) -> bytes:
    """The bytes of the regular file `path` (at most `limit`), as open_regular opens it."""
    with open_regular(path, root=root) as f:
        return f.read() if limit is None else f.read(limit)


def regular_stat(path: Path, *, root: Path) -> os.stat_result | None:
    """The regular file `path`'s status (not a link's target's); None when it is missing, a link,
    or not a regular file."""
    try:
        with open_regular(path, root=root) as f:
            return os.fstat(f.fileno())
    except OSError:
        return None


def write_fresh(path: Path, data: bytes | str, *, root: Path, mode: int = 0o644) -> None:
    """Write `data` as the file `path` (below `root`, its missing folders made): a new file under
    a random name in the same folder, renamed over `path`. Whatever `path` was (a link included)
    is replaced, never written through. Refused for a link among the folders."""
    raw = data.encode() if isinstance(data, str) else data
    name = Path(path).name
    parent = open_folder(Path(path).parent, root=root, create=True)
    try:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise
    finally:
        os.close(parent)


def open_append(path: Path, *, root: Path) -> BinaryIO:
    """The file `path` (below `root`) opened to append to (a log kept across attempts), created
    when missing. A link or anything but a regular file in its place is removed and a new file
    made (never appended through); Refused for a link among the folders."""
    name = Path(path).name
    parent = open_folder(Path(path).parent, root=root, create=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        for _ in range(3):
            try:
                fd = os.open(name, flags | os.O_CREAT, 0o644, dir_fd=parent)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise
                fd = -1
            if fd >= 0 and stat.S_ISREG(os.fstat(fd).st_mode):
                os.set_blocking(fd, True)
                return os.fdopen(fd, "ab")
            if fd >= 0:
                os.close(fd)
            os.unlink(name, dir_fd=parent)  # a link, a FIFO, a socket: gone (a folder: IsADirectoryError)
        raise Refused(errno.EINVAL, f"{path} keeps being replaced: not written")
    finally:
        os.close(parent)


def remove(path: Path, *, root: Path) -> bool:
    """Remove the name `path` (below `root`; a link is removed, not followed), without following
    a link among its folders. False when it was not there (or a folder on the way is a link)."""
    try:
        parent = open_folder(Path(path).parent, root=root)
    except (FileNotFoundError, Refused):
        return False
    try:
        os.unlink(Path(path).name, dir_fd=parent)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(parent)


def entries(path: Path, *, root: Path, match: Callable[[str], bool]) -> Iterator[tuple[str, os.stat_result]]:
    """The names below the folder `path` (itself below `root`) that `match` takes, recursively,
    as (path relative to `path`, its own status: S_ISREG for a regular file, S_ISLNK for a link). A link is never descended through. Nothing when `path` is missing; Refused when
    it (or a folder above it, below `root`) is a link."""
    try:
        top = open_folder(path, root=root)
    except FileNotFoundError:
        return
    try:
        yield from _scan(top, "", match)
    finally:
        os.close(top)


def _scan(fd: int, prefix: str, match: Callable[[str], bool]) -> Iterator[tuple[str, os.stat_result]]:
    for name in sorted(os.listdir(fd)):
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            mode = st.st_mode
        except FileNotFoundError:
            continue
        rel = f"{prefix}{name}"
        if stat.S_ISDIR(mode):
            try:
                sub = os.open(name, _DIR, dir_fd=fd)
            except OSError:  # replaced meanwhile (by a link: O_NOFOLLOW)
                continue
            try:
                yield from _scan(sub, f"{rel}/", match)
            finally:
                os.close(sub)
        elif match(name):
            yield rel, st
