"""The store every host reads and writes: uploaded workspaces, checkpoints and end-of-trial
checkpoints (later also job logs and users' environments), by key.

SHARDYARD_STORAGE_URL picks it:
- empty (the default): the data dir itself. A key is the file of that name under data_dir, exactly
  the paths the services used before there was a store, so nothing is ever copied (`is_data_dir`):
  one machine, or a data dir that every host mounts.
- `file:///abs/path`: a folder (for example a network mount) that is not the data dir; each host's
  data dir is then its own scratch space and cache, and files are copied in and out.
- `s3://bucket/prefix`: any S3-compatible store (AWS S3, MinIO, Ceph's RGW) through fsspec + s3fs;
  SHARDYARD_STORAGE_ENDPOINT_URL names a non-AWS endpoint, credentials come from the standard
  AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION variables. The bucket must exist.

Keys are relative slash-separated paths: workspaces/<sha256>.<tar.gz|zip>,
jobs/<id>/checkpoints/[<piece>/]step-<n>.pt, selections/<id>/trial-<i>/... Every failure is one
StorageError that names the store, the key and the cause, and an unreachable S3 endpoint answers
within seconds (short connect and read timeouts, few retries), so a worker can fail an attempt
with the reason instead of waiting minutes or starting without its checkpoint.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from core import safe_files
from core.settings import Settings

T = TypeVar("T")

CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 10.0
"""A working store answers a request (a multipart upload's part included) well within this; one
that accepts connections but never answers is given this long per request."""
OP_TIMEOUT_S = 30.0
MIN_RATE = 4 * 2**20
"""Every S3 operation also has a deadline: OP_TIMEOUT_S plus its bytes at MIN_RATE bytes/s. The
per-request timeouts alone do not bound an upload to a store that accepts the connection and
then hangs (the request waits for its `100 Continue`)."""
TRIES = 2
"""Tries per request, by s3fs's loop (with its short back-off) around botocore, which tries once:
a refused connection answers at once, a dead host within ~2 x CONNECT_TIMEOUT_S per request, a
hung one within ~2 x READ_TIMEOUT_S (a listing makes up to three requests)."""


class StorageError(RuntimeError):
    """An operation on the store failed: `url` (the store), `key`, `op` and the cause."""

    def __init__(self, *, url: str, key: str, op: str, cause: BaseException | str) -> None:
        self.url, self.key, self.op = url, key, op
        self.cause = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}".rstrip(": ")
        where = f"{url.rstrip('/')}/{key}" if key else url
        super().__init__(f"storage {where}: {op} failed: {self.cause}")


class KeyMissing(StorageError):
    """The store answered, and holds nothing under the key."""


def _check_key(key: str) -> str:
    """A relative key inside the store: no absolute path, no `..`, no empty parts."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"storage key {key!r}: give a relative path without '..' or empty parts")
    return key


@dataclass(frozen=True, slots=True)
class Storage:
    url: str
    """As configured (shown in every error): the data dir, file:///..., or s3://bucket/prefix."""
    fs: Any
    """The fsspec file system (LocalFileSystem or s3fs.S3FileSystem)."""
    root: str
    """The store's folder inside `fs` (a local path, or bucket/prefix), no trailing slash."""
    is_data_dir: bool
    """The store is this host's data dir: keys are its files, and nothing is copied."""

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, key: str) -> str:
        return f"{self.root}/{_check_key(key)}"

    def local_path(self, key: str) -> Path:
        """The file of `key` on this host (a file store only: the data dir or a mounted folder)."""
        if not self.local:
            raise ValueError(f"{self.url} is not a folder on this host")
        return Path(self.path(key))

    def _deadline(self, nbytes: int = 0) -> dict[str, float]:
        """fsspec's `timeout` keyword (its sync wrapper cancels the operation past it); none for a
        folder, whose operations are local system calls."""
        return {} if self.local else {"timeout": OP_TIMEOUT_S + nbytes / MIN_RATE}

    def _call(self, op: str, key: str, fn: Callable[[], T], *, whole_store: bool = False) -> T:
        if not whole_store:  # a bad key is the caller's bug (ValueError), not the store's failure
            _check_key(key.rstrip("/"))
        try:
            return fn()
        except StorageError:
            raise
        except FileNotFoundError as e:
            if op in ("download", "look up"):
                raise KeyMissing(url=self.url, key=key, op=op, cause="no such key") from e
            raise StorageError(url=self.url, key=key, op=op, cause=e) from e  # e.g. no such bucket
        except TimeoutError as e:  # fsspec's FSTimeoutError: the operation's deadline (_deadline)
            raise StorageError(url=self.url, key=key, op=op, cause="the store did not answer in time") from e
        except Exception as e:  # noqa: BLE001 - botocore, aiohttp and OS errors alike: one error, with the cause
            raise StorageError(url=self.url, key=key, op=op, cause=e) from e

    # ---- whole objects ------------------------------------------------------------------------

    def put_file(self, key: str, src: Path) -> None:
        """Upload the file `src` as `key` (put_fileobj on it, opened here). Readers never see a
        partial object: an S3 PUT is atomic, and a folder store writes a temporary name beside it
        and renames."""
        with open(src, "rb") as f:
            self.put_fileobj(key, f)

    def put_fileobj(self, key: str, src: BinaryIO) -> None:
        """Upload the open file `src` (from its start) as `key`, as put_file does: the bytes of
        the file that was opened, whatever its name on disk has become since (a checkpoint users'
        code could swap for a link after a check; core/safe_files.py)."""

        def put() -> None:
            dest = self.path(key)
            if not self.local:
                # s3fs uploads from a path: the open file's own (/proc/self/fd/N opens that file,
                # not a name); its multipart upload and this deadline stay as put_file's
                size = os.fstat(src.fileno()).st_size
                self.fs.put_file(f"/proc/self/fd/{src.fileno()}", dest, **self._deadline(size))
                return
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{dest}.{uuid.uuid4().hex[:8]}.part"
            try:
                src.seek(0)
                with open(tmp, "xb") as out:
                    shutil.copyfileobj(src, out, 2**20)
                os.replace(tmp, dest)
            finally:
                Path(tmp).unlink(missing_ok=True)

        self._call("upload", key, put)

    def _open_local(self, key: str) -> BinaryIO:
        """A folder store's file of `key`, never through a link below the store's folder (the data
        dir holds users' trainers' folders: core/safe_files.py); Refused for one."""
        return safe_files.open_regular(Path(self.path(key)), root=Path(self.root))

    def get_file(self, key: str, dest: Path, *, size: int = 2**30) -> None:
        """Download `key` to `dest`, atomically (a temporary name beside it, then a rename): a
        trainer that reads `dest` sees the whole file or none. KeyMissing when there is none.
        `size`: the object's size when known (its deadline; a GiB when not)."""

        def get() -> None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
            try:
                if self.local:
                    with self._open_local(key) as src, open(tmp, "xb") as out:
                        shutil.copyfileobj(src, out, 2**20)
                else:
                    self.fs.get_file(self.path(key), str(tmp), **self._deadline(size))
                if not tmp.exists():  # some fsspec versions say nothing for a missing object
                    raise FileNotFoundError(key)
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)

        self._call("download", key, get)

    def put_bytes(self, key: str, data: bytes) -> None:
        def put() -> None:
            if self.local:
                Path(self.path(key)).parent.mkdir(parents=True, exist_ok=True)
            self.fs.pipe_file(self.path(key), data, **self._deadline(len(data)))

        self._call("upload", key, put)

    def get_bytes(self, key: str) -> bytes:
        def get() -> bytes:
            if self.local:
                with self._open_local(key) as f:
                    return f.read()
            got: bytes = self.fs.cat_file(self.path(key), **self._deadline(2**30))
            return got

        return self._call("download", key, get)

    def open_read(self, key: str) -> Any:
        """`key` opened for reading, as a binary file object the caller reads and closes."""
        return self._call(
            "download",
            key,
            lambda: self._open_local(key) if self.local else self.fs.open(self.path(key), "rb"),
        )

    def exists(self, key: str) -> bool:
        return bool(self._call("look up", key, lambda: self.fs.exists(self.path(key), **self._deadline())))

    # ---- listing and removal ------------------------------------------------------------------

    def list(self, prefix: str) -> list[str]:
        """Every key under the folder `prefix` (recursive), sorted; [] when there is none."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every key under the folder `prefix` with its size in bytes."""
        prefix = _check_key(prefix.rstrip("/"))
        base = self.path(prefix)

        def find() -> dict[str, int]:
            if self.local:
                return self._local_sizes(prefix)
            self.fs.invalidate_cache()
            try:
                found = self.fs.find(base, detail=True, **self._deadline())
            except FileNotFoundError:
                return {}
            start = len(self.root.rstrip("/")) + 1
            # objects only: s3fs's find answers the folder itself when its listing came back empty
            # and its own look-up of the path then found objects written meanwhile (a node's first
            # upload), and a store may hold "folder/" marker objects (written by consoles and
            # some tools); neither is a key
            return {
                self._strip(p)[start:]: int(info.get("size") or 0)
                for p, info in found.items()
                if info.get("type") == "file" and not p.endswith("/")
            }

        return self._call("list", prefix + "/", find)

    def _local_sizes(self, prefix: str) -> dict[str, int]:
        """A folder store's regular files under `prefix`, never through a link (core/safe_files.py):
        a link, a FIFO or a folder link users' code left in its folder is no key."""
        root = Path(self.root)
        try:
            found = list(safe_files.entries(root / prefix, root=root, match=lambda _n: True))
        except safe_files.Refused:
            return {}
        return {f"{prefix}/{rel}": st.st_size for rel, st in found if stat.S_ISREG(st.st_mode)}

    def _strip(self, p: str) -> str:
        # s3fs lists without its protocol; a local fs with absolute paths: both under self.root
        return p.removeprefix("s3://")

    def delete(self, key: str) -> None:
        """Remove `key`; nothing when it is not there."""

        def rm() -> None:
            try:
                self.fs.rm_file(self.path(key), **self._deadline())
            except FileNotFoundError:
                pass

        self._call("delete", key, rm)

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under the folder `prefix`; returns how many were removed."""
        keys = self.list(prefix)
        if keys:
            paths = [self.path(k) for k in keys]
            self._call("delete", prefix.rstrip("/") + "/", lambda: self.fs.rm(paths, **self._deadline()))
        if self.local:  # the emptied folders too (an object store has none)
            folder = Path(self.path(prefix.rstrip("/")))
            for d in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
                d.rmdir() if not any(d.iterdir()) else None
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        return len(keys)

    def check(self) -> None:
        """Reach the store now (the root's listing); StorageError with the cause otherwise."""

        def probe() -> None:
            self.fs.invalidate_cache()
            if self.local:
                Path(self.root).mkdir(parents=True, exist_ok=True)
            else:  # s3fs's exists() takes any error for "no"; a listing says why
                self.fs.ls(self.root.split("/", 1)[0], detail=False, **self._deadline())

        self._call("reach the store", "", probe, whole_store=True)


def open_storage(*, url: str, data_dir: Path, endpoint_url: str = "") -> Storage:
    """The store of `url` (see the module's docstring). ValueError for a scheme it does not know."""
    if not url:
        root = str(Path(data_dir).resolve())
        return Storage(url=root, fs=fsspec.filesystem("file"), root=root, is_data_dir=True)
    if url.startswith("file://"):
        root = url.removeprefix("file://").rstrip("/")
        if not root.startswith("/"):
            raise ValueError(f"storage_url {url!r}: a file URL names an absolute folder (file:///path)")
        same = Path(root).resolve() == Path(data_dir).resolve()
        return Storage(url=url, fs=fsspec.filesystem("file"), root=root, is_data_dir=same)
    if url.startswith("s3://"):
        root = url.removeprefix("s3://").strip("/")
        if not root:
            raise ValueError(f"storage_url {url!r}: name a bucket (s3://bucket/prefix)")
        import s3fs  # only where an S3 store is configured

        fs = s3fs.S3FileSystem(
            endpoint_url=endpoint_url or None,
            # a fresh instance per process: s3fs runs its own event loop thread, which a forked
            # pool process must not share with its parent
            skip_instance_cache=True,
            use_listings_cache=False,
            config_kwargs={
                "connect_timeout": CONNECT_TIMEOUT_S,
                "read_timeout": READ_TIMEOUT_S,
                "retries": {"max_attempts": 1, "mode": "standard"},
            },
        )
        fs.retries = TRIES  # s3fs's own loop (5 by default)
        return Storage(url=url, fs=fs, root=root, is_data_dir=False)
    raise ValueError(
        f"storage_url {url!r}: use an empty value (the data dir), file:///path or s3://bucket/prefix"
    )


_CACHE: dict[tuple[int, str, str, str], Storage] = {}
_LOCK = threading.Lock()


def get_storage(settings: Settings) -> Storage:
    """The configured store, one per process (a forked child makes its own)."""
    key = (os.getpid(), settings.storage_url, settings.storage_endpoint_url, str(settings.data_dir))
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = open_storage(
                url=settings.storage_url,
                data_dir=settings.data_dir,
                endpoint_url=settings.storage_endpoint_url,
            )
        return _CACHE[key]


def workspace_key(digest: str, fmt: str) -> str:
    return f"workspaces/{digest}.{fmt}"


def job_prefix(job_id: int) -> str:
    return f"jobs/{job_id}"


def checkpoints_prefix(job_id: int) -> str:
    return f"jobs/{job_id}/checkpoints"


def selection_prefix(selection_id: int) -> str:
    return f"selections/{selection_id}"
