"""The worker's side of workspaces: unpack the job's uploaded archive into its job folder and hand
the folder to the trainer (`--workspace`), which puts it on the import path and resolves relative
data paths in it. The archive comes from the store (core/storage.py, content-addressed by its
sha256; with the default store that is the data dir shared with the API, else it is fetched into
this host's data dir, a cache) and is checked again with the API's own rules (core/archive.py)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from sqlalchemy.orm import Session

from core.archive import ArchiveError, extract_archive
from core.safe_files import write_fresh
from core.settings import Settings
from core.storage import KeyMissing, get_storage, workspace_key
from db.connection import session_for
from db.jobs import NotFound
from db.models import Job, Selection, Workspace
from db.workspaces import owned_workspace
from jobrules.spec import JobSpec

log = logging.getLogger(__name__)


class WorkspaceRefused(ValueError):
    """A spec names a workspace its job may not run: by id rather than digest, or bytes its owner
    never uploaded (a spec written past the API's pinning); the message says which."""


def owned_row(session: Session, ref: str, *, owner_id: int | None) -> Workspace:
    """`owner_id`'s workspace of the bytes `ref` (`sha256:<digest>`) names; WorkspaceRefused
    otherwise. Only a digest is resolved: an id is a row number anyone can count up to, and the
    API pins every spec to its digest at submit."""
    if not str(ref).startswith("sha256:"):
        raise WorkspaceRefused(
            f"the spec names workspace {str(ref)[:40]} by id; a worker runs a workspace named by its "
            f"digest only (the API pins each job and trial at submit: submit it again)"
        )
    try:
        return owned_workspace(session, ref, owner_id=owner_id)
    except NotFound:
        who = "rows from before users" if owner_id is None else f"user {owner_id}"
        raise WorkspaceRefused(
            f"refused: the job's owner ({who}) has no workspace of these bytes; a job runs only "
            f"its owner's workspaces"
        ) from None


def folder_owner(session: Session, *, settings: Settings, workdir: Path) -> int | None:
    """The owner of the job or batch whose folder `workdir` is: data_dir/jobs/<job id>[/node-k]
    (a job, a node of a gang) or data_dir/selections/<selection id> (a group of trials, all the
    batch owner's). WorkspaceRefused for any other folder: whose code it may run is unknown."""
    try:
        parts = workdir.resolve().relative_to(settings.data_dir.resolve()).parts
    except ValueError:
        parts = ()
    kinds = {"jobs": Job, "selections": Selection}
    if len(parts) >= 2 and parts[0] in kinds and parts[1].isdigit():
        row = session.get(kinds[parts[0]], int(parts[1]))
        if row is not None:
            return row.owner_id
    raise WorkspaceRefused(
        f"{workdir} is not the folder of a known job or batch: whose workspace it may run is unknown"
    )


def unpack_workspace(ref: str | None, *, settings: Settings, workdir: Path) -> Path | None:
    """The unpacked workspace folder of the job in `workdir` whose spec names workspace `ref` (None
    when it names none).
    Unpacking is atomic and skipped when a previous attempt of the job already did it. In a folder
    a spare sandboxed trainer was adopted as (workers/spare.py), `workspace/` is its read-only
    placeholder and the workspace goes to `workspace/tree`. The
    workspace is resolved by its digest among the job owner's own (`owned_row`). When it is gone or
    refused, the folder is left missing and the trainer fails the job naming the reason. A store
    that cannot be reached raises StorageError (the attempt fails with it)."""
    if ref is None:
        return None
    dest = workdir / "workspace"
    tree = dest / "tree"  # below a spare's read-only placeholder (workers/spare.py)
    for name in (dest, tree):  # outer first: tree is looked at only below a real folder
        if name.is_symlink():  # left by an earlier attempt's trainer: never followed, unpacked again
            name.unlink()
    if tree.is_dir():
        return tree
    if dest.is_dir() and any(dest.iterdir()):
        return dest  # an earlier attempt unpacked it
    if dest.is_dir():
        # empty: the placeholder of the sandbox made ahead, read-only there; unpacked below it
        # in one rename, as a fresh unpack is
        dest = tree
    try:
        with session_for(settings.database_url) as s:
            owner_id = folder_owner(s, settings=settings, workdir=workdir)
            row = owned_row(s, ref, owner_id=owner_id)
            digest, fmt = row.digest, row.format
        blob = fetch_archive(settings, digest=digest, fmt=fmt)
        extract_archive(blob, dest, max_unpacked=int(settings.workspace_max_unpacked_mb * 2**20))
    except (WorkspaceRefused, NotFound, KeyMissing, ArchiveError, OSError) as e:
        log.error("workspace %s of %s: %s", ref, workdir.name, e)
        write_fresh(workdir / "workspace.error", f"workspace {ref}: {e}\n", root=workdir.parent)
    return dest


def fetch_archive(settings: Settings, *, digest: str, fmt: str) -> Path:
    """The archive's file on this host: the store's own file with the default store, else a copy
    in this host's data dir, fetched once. Its bytes are checked against `digest` before every
    unpack (a file named by a hash is only as good as its last check): a cached copy that does not
    match is fetched again, and a store's file that does not match is refused (ArchiveError)."""
    storage = get_storage(settings)
    key = workspace_key(digest, fmt)
    if storage.is_data_dir:
        return _checked(storage.local_path(key), digest)
    cached = settings.workspaces_dir / f"{digest}.{fmt}"
    if cached.is_file() and _sha256(cached) != digest:
        log.warning("workspace archive %s changed in this host's cache: fetched again", cached.name)
        cached.unlink()
    if not cached.is_file():
        storage.get_file(key, cached)
    return _checked(cached, digest)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _checked(path: Path, digest: str) -> Path:
    if (got := _sha256(path)) != digest:
        raise ArchiveError(
            f"the stored archive's bytes do not match its digest (sha256 {got[:12]}, not {digest[:12]})"
        )
    return path


def workspace_args(spec: JobSpec, *, settings: Settings, workdir: Path) -> list[str]:
    """The trainer's command-line arguments for the job's workspace (none without one)."""
    dest = unpack_workspace(spec.workspace, settings=settings, workdir=workdir)
    return [] if dest is None else ["--workspace", str(dest)]
