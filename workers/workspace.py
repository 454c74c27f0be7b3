"""The worker's side of workspaces: unpack the job's uploaded archive into its job folder and hand
the folder to the trainer (`--workspace`), which puts it on the import path and resolves relative
data paths in it. The archive comes from the store (core/storage.py, content-addressed by its
sha256; with the default store that is the data dir shared with the API, else it is fetched into
this host's data dir, a cache) and is checked again with the API's own rules (core/archive.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from core.archive import ArchiveError, extract_archive
from core.settings import Settings
from core.storage import KeyMissing, get_storage, workspace_key
from db.engine import session_for
from db.jobs import NotFound
from db.workspaces import get_workspace

log = logging.getLogger(__name__)


def unpack_workspace(spec: dict[str, Any], *, settings: Settings, workdir: Path) -> Path | None:
    """The unpacked workspace folder of the job in `workdir` (None when the spec names none).
    Unpacking is atomic and skipped when a previous attempt of the job already did it. When the
    workspace is gone, the folder is left missing and the trainer fails the job naming it. A store
    that cannot be reached raises StorageError (the attempt fails with it)."""
    ref = spec.get("workspace")
    if ref is None:
        return None
    dest = workdir / "workspace"
    if dest.is_dir():
        return dest
    try:
        with session_for(settings.database_url) as s:
            row = get_workspace(s, ref)
            digest, fmt = row.digest, row.format
        blob = fetch_archive(settings, digest=digest, fmt=fmt)
        extract_archive(blob, dest, max_unpacked=int(settings.workspace_max_unpacked_mb * 2**20))
    except (NotFound, KeyMissing, ArchiveError, OSError) as e:
        log.error("workspace %s of %s: %s", ref, workdir.name, e)
        (workdir / "workspace.error").write_text(f"workspace {ref}: {e}\n")
    return dest


def fetch_archive(settings: Settings, *, digest: str, fmt: str) -> Path:
    """The archive's file on this host: the store's own file with the default store, else a copy
    in this host's data dir, fetched once (the name is its content's hash, so a cached copy is
    never stale)."""
    storage = get_storage(settings)
    key = workspace_key(digest, fmt)
    if storage.is_data_dir:
        return storage.local_path(key)
    cached = settings.workspaces_dir / f"{digest}.{fmt}"
    if not cached.is_file():
        storage.get_file(key, cached)
    return cached


def workspace_args(spec: dict[str, Any], *, settings: Settings, workdir: Path) -> list[str]:
    """The trainer's command-line arguments for the job's workspace (none without one)."""
    dest = unpack_workspace(spec, settings=settings, workdir=workdir)
    return [] if dest is None else ["--workspace", str(dest)]
