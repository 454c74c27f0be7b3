"""A workspace as the API takes it: a folder packed into a .tar.gz, or an archive file as it is
(a plain .tar is gzipped first: the API reads .tar.gz and .zip)."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

from shardyard.errors import ShardyardError

SKIP_DIRS = {"__pycache__", ".git", ".venv", "node_modules", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def pack_folder(folder: Path) -> bytes:
    """`folder` as a .tar.gz whose members are relative to it (caches and VCS folders left out).
    Symlinks are refused here, as the server would refuse them."""
    if not folder.is_dir():
        raise ShardyardError(f"workspace {folder}: not a folder")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if SKIP_DIRS.intersection(rel.parts):
                continue
            if path.is_symlink():
                raise ShardyardError(f"workspace: {rel} is a symlink; workspaces hold plain files only")
            if path.is_file():
                tar.add(path, arcname=rel.as_posix(), recursive=False)
    return buf.getvalue()


def archive_body(path: Path) -> tuple[bytes, str]:
    """(the bytes to upload, their content type) for a folder or an archive file."""
    if path.is_dir():
        return pack_folder(path), "application/gzip"
    try:
        body = path.read_bytes()
    except OSError as e:
        raise ShardyardError(f"workspace {path}: {e.strerror}") from e
    if body[:2] == b"\x1f\x8b":
        return body, "application/gzip"
    if body[:4] == b"PK\x03\x04":
        return body, "application/zip"
    if len(body) > 262 and body[257:262] == b"ustar":
        return gzip.compress(body), "application/gzip"
    raise ShardyardError(f"workspace {path}: neither a folder nor a .tar, .tar.gz or .zip archive")
