"""Workspace archives (.tar.gz or .zip): what the API checks at upload and what the workers unpack.

One set of rules for both sides, so a worker never unpacks what the API would have refused:
members are plain files and folders with relative paths that stay inside the destination (no
absolute paths, no `..`), no symlinks, hardlinks or device files, and the unpacked total and the
member count are bounded (a zip bomb stops at the bound, whatever its headers claim).
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

MAX_MEMBERS = 10_000
_CHUNK = 1 << 20


class ArchiveError(ValueError):
    """An archive refused; the message names the member and the rule."""


@dataclass(frozen=True, slots=True)
class ArchiveInfo:
    format: str
    """`tar.gz` or `zip`."""
    files: int
    unpacked_bytes: int


def sniff(head: bytes) -> str:
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[:4] == b"PK\x03\x04" or head[:4] == b"PK\x05\x06":
        return "zip"
    raise ArchiveError("the upload is neither a .tar.gz (gzip) nor a .zip archive")


def _safe_name(name: str) -> PurePosixPath:
    if "\\" in name:
        name = name.replace("\\", "/")
    p = PurePosixPath(name)
    if p.is_absolute() or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise ArchiveError(f"member {name!r} has an absolute path")
    if ".." in p.parts:
        raise ArchiveError(f"member {name!r} has a '..' component (path traversal)")
    parts = [x for x in p.parts if x not in ("", ".")]
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


@dataclass(slots=True)
class _Member:
    name: PurePosixPath
    is_dir: bool
    mode: int
    open: object  # () -> IO[bytes] | None


def _tar_members(f: IO[bytes]) -> Iterator[_Member]:
    try:
        with tarfile.open(fileobj=f, mode="r:gz") as tar:
            for m in tar:
                name = _safe_name(m.name)
                if m.issym() or m.islnk():
                    raise ArchiveError(
                        f"member {m.name!r} is a {'symlink' if m.issym() else 'hardlink'} (to {m.linkname!r})"
                    )
                if m.isdir():
                    yield _Member(name=name, is_dir=True, mode=0o755, open=None)
                elif m.isfile():
                    yield _Member(name=name, is_dir=False, mode=m.mode, open=lambda m=m: tar.extractfile(m))
                else:
                    raise ArchiveError(f"member {m.name!r} is a device, fifo or other special file")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArchiveError(f"the .tar.gz archive is damaged: {e}") from e


def _zip_members(f: IO[bytes]) -> Iterator[_Member]:
    try:
        with zipfile.ZipFile(f) as zf:
            for info in zf.infolist():
                name = _safe_name(info.filename)
                mode = info.external_attr >> 16
                kind = stat.S_IFMT(mode)
                if kind == stat.S_IFLNK:
                    raise ArchiveError(f"member {info.filename!r} is a symlink")
                if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                    raise ArchiveError(f"member {info.filename!r} is a device, fifo or other special file")
                if info.is_dir():
                    yield _Member(name=name, is_dir=True, mode=0o755, open=None)
                else:
                    yield _Member(name=name, is_dir=False, mode=mode or 0o644, open=lambda i=info: zf.open(i))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, NotImplementedError) as e:
        raise ArchiveError(f"the .zip archive is damaged: {e}") from e


def _members(path: Path) -> Iterator[_Member]:
    with path.open("rb") as f:
        fmt = sniff(f.read(4))
        f.seek(0)
        yield from (_tar_members(f) if fmt == "tar.gz" else _zip_members(f))


def _walk(path: Path, *, max_unpacked: int, dest: Path | None) -> ArchiveInfo:
    """Check every member (and write it under `dest` when given), counting real decompressed bytes."""
    total = files = count = 0
    for m in _members(path):
        count += 1
        if count > MAX_MEMBERS:
            raise ArchiveError(f"the archive has more than {MAX_MEMBERS} members")
        target = dest / m.name if dest is not None else None
        if m.is_dir:
            if target is not None:
                target.mkdir(parents=True, exist_ok=True)
            continue
        files += 1
        src = m.open()  # type: ignore[operator]
        out = None
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            out = target.open("wb")
        try:
            while chunk := src.read(_CHUNK):
                total += len(chunk)
                if total > max_unpacked:
                    raise ArchiveError(
                        f"the archive unpacks to more than {max_unpacked / 2**20:g} MiB "
                        f"(the workspace_max_unpacked_mb setting)"
                    )
                if out is not None:
                    out.write(chunk)
        finally:
            src.close()
            if out is not None:
                out.close()
        if target is not None:
            os.chmod(target, 0o755 if m.mode & 0o111 else 0o644)
    if files == 0:
        raise ArchiveError("the archive holds no files")
    return ArchiveInfo(format=_format(path), files=files, unpacked_bytes=total)


def _format(path: Path) -> str:
    with path.open("rb") as f:
        return sniff(f.read(4))


def inspect_archive(path: Path, *, max_unpacked: int) -> ArchiveInfo:
    """Check an archive without writing anything; raises ArchiveError with the reason."""
    return _walk(path, max_unpacked=max_unpacked, dest=None)


def read_member(path: Path, name: str, *, max_bytes: int) -> bytes | None:
    """The bytes of the file `name` (a path inside the archive) as unpacking would leave it, or
    None when the archive has no such file; ArchiveError past `max_bytes`. A later member of the
    same name replaces an earlier one when unpacked, so the last one is read."""
    want = PurePosixPath(name)
    found: bytes | None = None
    for m in _members(path):
        if m.is_dir or m.name != want:
            continue
        src = m.open()  # type: ignore[operator]
        try:
            found = src.read(max_bytes + 1)
        finally:
            src.close()
        if len(found) > max_bytes:
            raise ArchiveError(f"member {name!r} is larger than {max_bytes} bytes")
    return found


def extract_archive(path: Path, dest: Path, *, max_unpacked: int) -> ArchiveInfo:
    """Unpack into `dest` atomically: into a sibling temporary folder, renamed into place, so a
    concurrent or half-finished unpack never leaves a partial workspace behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        info = _walk(path, max_unpacked=max_unpacked, dest=tmp)
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.is_dir():
                raise
            shutil.rmtree(tmp)  # another unpack of the same archive won
        return info
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
