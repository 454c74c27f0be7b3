"""Checkpoints between a worker's local job folder and the store (core/storage.py).

The trainer only ever reads and writes local files (it stays pure PyTorch). Around it, the worker:
- restores before an attempt starts (`Mirror.restore`): from the store's copies, the newest step
  at or below the job's applied_step that is whole across every rank's piece (`past_or_partial`,
  the rule of workers/execute.py drop_checkpoints_past: resuming past applied_step would lose
  metric lines, and ranks resuming from different steps would corrupt the run) is downloaded for
  every piece, because which ranks land on this node is only known after the rendezvous. The
  store is the truth: copies past the rule are deleted there, and local files the store does not
  hold as usable are removed, so every node of a gang resumes from the same step whatever its disk
  held before.
- uploads what the trainer writes while it runs (`Uploader`, a thread): every `storage_sync_s`,
  and at once when the trainer reports a checkpoint, newest first; a file the trainer prunes
  (SHARDYARD_CHECKPOINT_KEEP) or a selection executor removes is deleted in the store too. A
  rank's piece of a pipeline or tensor layout is deleted there only below the store's floor
  (`store_floor`): the newest step at or below the applied step that every piece holds IN THE
  STORE. Each node prunes and uploads its own pieces on its own schedule, so one node's copies in
  the store can lag its folder by several checkpoints (a slow upload, a node frozen or killed
  before its next sync) while another node's follow its folder closely; mirroring each folder's
  pruning alone then left the two nodes' copies with no step in common, and the next attempt of
  the gang started from step 0 on every node. A deletion held back is tried again at each sync.
  A failed upload is reported in the job's log and tried again; it never stops the trainer.
- syncs once more when the trainer has exited, unless the attempt was fenced off (a newer attempt
  owns the store's copies then).

The checkpoint folder is written by users' code, which may leave links there: every file is
opened below the folder above it (the sandbox's bind, which the trainer cannot replace) without
following a link (core/safe_files.py), and uploaded from the open file. A link or anything but a
regular file named as a checkpoint, or a link in place of a folder, is never read, written or
removed through; it is told once in the job's log ("... is a symbolic link: not uploaded").

With the default store (the data dir itself) none of this runs: the trainer's folder is the store.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from core import safe_files
from core.safe_files import Refused
from core.storage import Storage, StorageError
from db.connection import session_for
from db.ingest import add_event
from jobrules.applied import APPLIED_FILE, kept_steps

log = logging.getLogger(__name__)

PREFIX, SUFFIX = "step-", ".pt"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint's file name (`step-00000040.pt`), None for anything else."""
    if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
        return None
    digits = name[len(PREFIX) : -len(SUFFIX)]
    return int(digits) if digits.isdigit() else None


def _is_piece(folder: str) -> bool:
    return bool(folder) and "/" not in folder


def _piece_steps(found: dict[str, set[int]]) -> list[set[int]]:
    """The steps each rank piece (a direct sub-folder) in `found` holds."""
    return [set(steps) for folder, steps in found.items() if _is_piece(folder)]


def past_or_partial(found: dict[str, set[int]], step: int) -> set[tuple[str, int]]:
    """(folder, step) of the checkpoints a resume at or below `step` must not use. `found` maps a
    folder relative to the checkpoint folder ("" itself, "pp0-tp1" a rank's piece) to the steps
    it holds. A step past `step` is unusable (its metric lines are not all in the database), and
    so is a step whose pieces are not all there (a rank died between the writes). Pieces are the
    direct sub-folders; with a checkpoint on top, or fewer than two pieces, there is nothing to
    match up."""
    pieces = _piece_steps(found)
    whole = None if "" in found or len(pieces) < 2 else set.intersection(*pieces)
    return {
        (folder, at)
        for folder, steps in found.items()
        for at in steps
        if at > step or (whole is not None and at not in whole)
    }


def store_floor(found: dict[str, set[int]], *, applied: int | None, pieces: int = 0) -> int | None:
    """The newest step at or below `applied` (None: any step) that every rank piece in `found`
    holds (found: folder -> steps, as in past_or_partial), or None when there is none. `pieces` is
    how many pieces the job's layout has (0: those in `found`); while fewer are there, no step is
    whole. A piece's copy below this step may go: a resume (past_or_partial) keeps this step or a
    newer whole one, whatever another node deletes meanwhile (each deletes only below its own
    floor, so the highest floor any node saw stays whole)."""
    whole = _whole_steps(found, pieces=pieces)
    return max((s for s in whole or () if applied is None or s <= applied), default=None)


def _whole_steps(found: dict[str, set[int]], *, pieces: int = 0) -> set[int] | None:
    """The steps every rank piece in `found` holds; None while fewer than `pieces` (or no piece)
    are there."""
    held = _piece_steps(found)
    if not held or len(held) < pieces:
        return None
    return set.intersection(*held)


def scan_checkpoints(root: Path, *, within: Path | None = None) -> tuple[dict[str, Path], list[str]]:
    """The regular checkpoint files under `root` by their path relative to it, and what was not
    taken: a checkpoint's name that is a link or no regular file, or `root` itself a link (each as
    its path and why). `within`: the folder `root` is in that users' code cannot replace (the
    default: the one above `root`); nothing below it is followed (core/safe_files.py)."""
    try:
        found = list(
            safe_files.entries(root, root=within or root.parent, match=lambda n: parse_step(n) is not None)
        )
    except Refused as e:
        return {}, [str(e)]
    except NotADirectoryError:
        return {}, []
    files = {rel: root / rel for rel, st in found if stat.S_ISREG(st.st_mode)}
    odd = [
        f"{root / rel} is {'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a regular file'}"
        for rel, st in found
        if not stat.S_ISREG(st.st_mode)
    ]
    return files, odd


def local_checkpoints(root: Path, *, within: Path | None = None) -> dict[str, Path]:
    """Checkpoint files under `root` by their path relative to it: regular files only, never
    through a link (scan_checkpoints)."""
    return scan_checkpoints(root, within=within)[0]


def prune_local(root: Path, *, keep: int, applied: int | None) -> list[Path]:
    """The trainer's pruning (jobrules/applied.py kept_steps) of the checkpoint folder `root` and
    each rank piece in it, by `applied`: what the worker does once the job has ended, since no
    trainer prunes after its last save (whose applied-step file lagged the last lines). Returns
    what was removed."""
    by_folder: dict[str, list[tuple[int, Path]]] = {}
    for rel, path in local_checkpoints(root).items():
        folder, _, name = rel.rpartition("/")
        by_folder.setdefault(folder, []).append((parse_step(name) or 0, path))
    removed = []
    for items in by_folder.values():
        kept = kept_steps([s for s, _ in items], keep=keep, applied=applied)
        for step, path in items:
            if step not in kept:
                safe_files.remove(path, root=root.parent)
                removed.append(path)
    return sorted(removed)


def _by_folder(rels: Iterable[str]) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for rel in rels:
        folder, _, name = rel.rpartition("/")
        step = parse_step(name)
        if step is not None:
            found.setdefault(folder, set()).add(step)
    return found


def _rel(folder: str, step: int) -> str:
    name = f"{PREFIX}{step:08d}{SUFFIX}"
    return f"{folder}/{name}" if folder else name


@dataclass
class Restored:
    step: int | None
    """The newest step restored (None: the store holds no usable checkpoint)."""
    downloaded: int = 0
    dropped: int = 0


@dataclass
class Mirror:
    """One local checkpoint folder and its prefix in the store."""

    storage: Storage
    local: Path
    prefix: str
    known: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Files the store holds as they are here: relative path -> (size, mtime_ns)."""
    pieces: int = 0
    """How many rank pieces a checkpoint of the job has (pipeline stages x tensor ranks; 0: a
    checkpoint is one file, or count the pieces in the store): see store_floor."""
    within: Path | None = None
    """The folder `local` is in that users' code cannot replace (None: the one above `local`,
    which is the sandbox's bind or above it for a job's, a gang's and a trial's folder)."""
    told: set[str] = field(default_factory=set)
    """What was refused and already told (see `notes`)."""
    notes: list[str] = field(default_factory=list)
    """Refusals not yet told in the job's log (the Uploader tells them)."""

    @property
    def trusted(self) -> Path:
        return self.within or self.local.parent

    def _scan(self) -> dict[str, Path]:
        here, odd = scan_checkpoints(self.local, within=self.trusted)
        for what in odd:
            self._refuse(what)
        return here

    def _refuse(self, what: str) -> None:
        what = what.removeprefix(f"{self.trusted}/")  # named as in the job's own folder
        if what not in self.told:
            self.told.add(what)
            self.notes.append(f"checkpoint {what}: not uploaded")
            log.warning("checkpoint %s: not uploaded", what)

    def _stat(self, rel: str) -> os.stat_result | None:
        return safe_files.regular_stat(self.local / rel, root=self.trusted)

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def _remote(self) -> dict[str, int]:
        start = len(self.prefix) + 1
        return {
            k[start:]: size
            for k, size in self.storage.sizes(self.prefix).items()
            if parse_step(k.rpartition("/")[2]) is not None
        }

    def restore(self, *, applied_step: int | None, prune: bool = True) -> Restored:
        """Make the local folder hold the store's usable checkpoints (see the module docstring):
        the newest usable step of every folder is downloaded; `applied_step` None takes every step
        (a finished trial a warm start reads). `prune` False leaves the store and the local files
        alone but for downloads (someone else's folder). StorageError when the store cannot be
        read: the caller fails the attempt rather than start from step 0."""
        remote = self._remote()
        found = _by_folder(remote)
        drop = past_or_partial(found, applied_step) if applied_step is not None else set()
        out = Restored(step=None)
        if prune:
            for folder, at in sorted(drop):
                self.storage.delete(self.key(_rel(folder, at)))
                out.dropped += 1
        usable = {
            rel: size
            for rel, size in remote.items()
            if (rel.rpartition("/")[0], parse_step(rel.rpartition("/")[2])) not in drop
        }
        here = self._scan()
        if prune:
            for rel, path in here.items():
                if rel not in usable:
                    safe_files.remove(path, root=self.trusted)
        for folder, steps in _by_folder(usable).items():
            rel = _rel(folder, max(steps))
            st = self._stat(rel)
            if st is None or st.st_size != usable[rel]:
                dest = self.local / rel
                safe_files.remove(dest, root=self.trusted)  # a link in its place goes, unfollowed
                try:
                    with safe_files.folder(dest.parent, root=self.trusted, create=True) as d:
                        self.storage.get_file(self.key(rel), d / dest.name, size=usable[rel])
                except Refused as e:  # a folder on the way is a link: not restored through it
                    self._refuse(str(e))
                    continue
                out.downloaded += 1
            out.step = max(steps) if out.step is None else min(out.step, max(steps))
        for rel in self._scan():
            if rel in usable and (st := self._stat(rel)) is not None and st.st_size == usable[rel]:
                self.known[rel] = (st.st_size, st.st_mtime_ns)
        return out

    def sync(self) -> int:
        """Upload the local checkpoints the store lacks (newest first) and delete in the store
        those that were removed here. Returns how many objects changed; StorageError on failure
        (what was done stays done)."""
        here = self._scan()
        changed = 0
        newest_first = sorted(here, key=lambda r: (-(parse_step(r.rpartition("/")[2]) or 0), r))
        for rel in newest_first:
            # opened once, never through a link, and uploaded from the open file: a name swapped
            # for a link after the listing cannot win
            try:
                f = safe_files.open_regular(here[rel], root=self.trusted)
            except Refused as e:
                self._refuse(str(e).removesuffix(": not followed").removesuffix(": not read"))
                continue
            except FileNotFoundError:
                continue  # pruned meanwhile: the deletions below
            with f:
                st = os.fstat(f.fileno())
                sig = (st.st_size, st.st_mtime_ns)
                if self.known.get(rel) == sig:
                    continue
                self.storage.put_fileobj(self.key(rel), f)
            self.known[rel] = sig
            changed += 1
        gone = [rel for rel in self.known if self._stat(rel) is None]
        for rel in self._deletable(gone):
            self.storage.delete(self.key(rel))
            del self.known[rel]
            changed += 1
        return changed

    def prune_store(self, *, keep: int, applied: int | None) -> int:
        """Once the job has ended: the store's copies pruned as a folder is (kept_steps), from
        the store's own listing, so copies no attempt's folder holds any more (older usable steps
        a restore left there, deletions held back) go too. A checkpoint that is one file keeps
        kept_steps' steps; rank pieces keep the newest `keep` steps every piece holds and every
        step from store_floor on (nothing while none is whole: another node's last upload may
        still be on its way, and the node that ends last prunes what this one left). Returns how
        many objects were deleted (0 with `keep` 0: all stay)."""
        if keep <= 0:
            return 0
        found = _by_folder(self._remote())
        drop: list[str] = []
        for folder, steps in found.items():
            if not _is_piece(folder):
                drop += [_rel(folder, s) for s in steps - kept_steps(list(steps), keep=keep, applied=applied)]
        floor = store_floor(found, applied=applied, pieces=self.pieces)
        if floor is not None:  # (so every piece is there)
            kept = set(sorted(_whole_steps(found) or ())[-keep:])
            for folder, steps in found.items():
                if _is_piece(folder):
                    drop += [_rel(folder, s) for s in sorted(steps) if s < floor and s not in kept]
        for rel in drop:
            self.storage.delete(self.key(rel))
            self.known.pop(rel, None)
        return len(drop)

    def _deletable(self, gone: list[str]) -> list[str]:
        """Of the copies whose local file is gone, those the store may lose now: a rank piece's
        only below store_floor (read from the store's listing and the folder's applied-step
        file); anything else at once (a checkpoint that is one file, whose newer steps this sync
        uploaded first; a folder that was removed whole)."""
        pieces = [rel for rel in gone if _is_piece(rel.rpartition("/")[0])]
        if not pieces or not self.local.is_dir():
            return gone
        try:
            text = safe_files.read_regular(self.local / APPLIED_FILE, root=self.trusted, limit=64)
            applied = int(text.strip())
        except (OSError, ValueError):
            applied = None
        floor = store_floor(_by_folder(self._remote()), applied=applied, pieces=self.pieces)
        held = {rel for rel in pieces if floor is None or (parse_step(rel.rpartition("/")[2]) or 0) >= floor}
        return [rel for rel in gone if rel not in held]


class Uploader:
    """A thread that keeps `mirrors` synced while a trainer runs. `allowed()` False (the attempt
    was fenced off) stops every write to the store; `report(message)` tells the job's log about a
    failure and about the recovery after one."""

    def __init__(
        self,
        mirrors: list[Mirror],
        *,
        interval_s: float,
        report: Callable[[str], None],
        allowed: Callable[[], bool] = lambda: True,
    ) -> None:
        self.mirrors, self.interval_s, self.report, self.allowed = mirrors, interval_s, report, allowed
        self._wake, self._stop = threading.Event(), threading.Event()
        self._failing: str | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)

    def start(self) -> Uploader:
        self._thread.start()
        return self

    def wake(self) -> None:
        """The trainer reported a checkpoint: sync now."""
        self._wake.set()

    def sync_all(self) -> bool:
        if not self.allowed():
            return True
        try:
            for m in self.mirrors:
                try:
                    m.sync()
                finally:
                    while m.notes:
                        self._tell(m.notes.pop(0))
        except StorageError as e:
            if self._failing != str(e):
                self._failing = str(e)
                self._tell(f"checkpoint upload failed, retrying: {e}")
            return False
        except OSError as e:  # the local folder itself (a full or vanished disk): same treatment
            return self._local_error(e)
        if self._failing is not None:
            self._failing = None
            self._tell(f"checkpoint uploads to {self.mirrors[0].storage.url} work again")
        return True

    def _local_error(self, e: OSError) -> bool:
        if self._failing != str(e):
            self._failing = str(e)
            self._tell(f"checkpoint upload failed, retrying: {e}")
        return False

    def _tell(self, message: str) -> None:
        log.warning("%s", message)
        try:
            self.report(message)
        except Exception:  # noqa: BLE001 - a report that cannot be written must not stop uploads
            log.exception("could not record: %s", message)

    def _run(self) -> None:
        while not self._stop.is_set():
            ok = self.sync_all()
            # after a failure, a little longer: an outage is not hammered twice a second
            self._wake.wait(self.interval_s if ok else max(self.interval_s, 5.0))
            self._wake.clear()

    def stop(self, *, final: bool, tries: int = 3) -> bool:
        """Stop the thread; with `final`, sync once more (a few tries). True when the store holds
        every local checkpoint."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=120)
        if not final:
            return False
        for i in range(tries):
            if self.sync_all():
                return True
            time.sleep(min(2.0 * (i + 1), 5.0))
        self._tell(f"the attempt's last checkpoints did not reach the store after {tries} tries")
        return False


def job_reporter(database_url: str, job_ids: list[int]) -> Callable[[str], None]:
    """Writes a message into the log of each of `job_ids` (what `GET /api/jobs/{id}/logs` shows)."""

    def report(message: str) -> None:
        with session_for(database_url) as s:
            for job_id in job_ids:
                add_event(s, job_id=job_id, kind="log", message=message)

    return report


def storage_failure(e: StorageError) -> str:
    """The error an attempt fails with when the store cannot be read at its start."""
    return f"the checkpoint and workspace store could not be read, so the attempt did not start: {e}"
