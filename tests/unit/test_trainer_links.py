"""Links that users' code plants in the folders it shares with the worker are never followed by
the worker (core/safe_files.py, docs/security.md): not when it uploads a checkpoint, not when a
folder store serves one, not when it writes its own files there. Real files and links on a tmp
folder; the hostile end-to-end run is tests/integration/test_trainer_links.py."""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

import pytest

from core.safe_files import (
    Refused,
    entries,
    folder,
    open_append,
    open_regular,
    read_regular,
    remove,
    write_fresh,
)
from core.storage import open_storage
from workers.ckpt_sync import Mirror, Uploader, local_checkpoints

PREFIX = "jobs/9/checkpoints"


@pytest.fixture
def job(tmp_path: Path) -> Path:
    d = tmp_path / "jobs" / "9"
    (d / "checkpoints").mkdir(parents=True)
    return d


@pytest.fixture
def secret(tmp_path: Path) -> tuple[Path, bytes]:
    (tmp_path / "worker-only").mkdir()
    path = tmp_path / "worker-only" / "secret"
    value = secrets.token_hex(16).encode()
    path.write_bytes(value)
    return path, value


# ---- the helper ----------------------------------------------------------------------------------


def test_a_link_at_the_file_is_refused(job: Path, secret: tuple[Path, bytes]) -> None:
    link = job / "checkpoints" / "step-00000001.pt"
    link.symlink_to(secret[0])
    with pytest.raises(Refused, match="symbolic link"):
        open_regular(link, root=job)
    with pytest.raises(Refused):
        read_regular(link, root=job)


def test_a_link_as_a_folder_on_the_way_is_refused(job: Path, secret: tuple[Path, bytes]) -> None:
    (job / "checkpoints").rmdir()
    (job / "checkpoints").symlink_to(secret[0].parent)
    with pytest.raises(Refused, match="checkpoints is a symbolic link"):
        open_regular(job / "checkpoints" / "secret", root=job)
    with pytest.raises(Refused):
        write_fresh(job / "checkpoints" / "applied-step", "3", root=job)
    with pytest.raises(Refused):
        list(entries(job / "checkpoints", root=job, match=lambda n: True))
    assert not remove(job / "checkpoints" / "secret", root=job)
    assert sorted(os.listdir(secret[0].parent)) == ["secret"]


def test_a_fifo_a_device_and_a_folder_are_not_regular_files(job: Path) -> None:
    os.mkfifo(job / "fifo")
    (job / "dir").mkdir()
    for name in ("fifo", "dir"):  # a FIFO with no writer: refused at once, never a blocked open
        with pytest.raises(Refused, match="not a regular file"):
            open_regular(job / name, root=job)
    (job / "null").symlink_to("/dev/null")
    with pytest.raises(Refused):
        open_regular(job / "null", root=job)
    assert read_regular(job / "x", root=job) if (job / "x").write_bytes(b"ok") else False


def test_a_fresh_write_replaces_a_link_and_never_writes_through_it(
    job: Path, secret: tuple[Path, bytes]
) -> None:
    spec = job / "spec.json"
    spec.symlink_to(secret[0])
    write_fresh(spec, '{"a": 1}', root=job)
    assert secret[0].read_bytes() == secret[1]
    assert not spec.is_symlink() and spec.read_text() == '{"a": 1}'
    # a dangling link (its target to be created through it) too
    (job / "stop").symlink_to(secret[0].parent / "created")
    write_fresh(job / "stop", b"", root=job)
    assert not (secret[0].parent / "created").exists()
    assert sorted(os.listdir(job)) == ["checkpoints", "spec.json", "stop"]  # no temporary left


def test_a_fresh_write_races_a_planter_and_never_writes_through(
    job: Path, secret: tuple[Path, bytes]
) -> None:
    # a thread keeps turning the name into a link while the worker writes it over and over
    stop = threading.Event()
    dest = job / "group-0.json"

    def plant() -> None:
        while not stop.is_set():
            tmp = job / f"l.{secrets.token_hex(4)}"
            tmp.symlink_to(secret[0])
            os.replace(tmp, dest)

    t = threading.Thread(target=plant)
    t.start()
    try:
        for i in range(300):
            write_fresh(dest, f"batch {i}", root=job)
    finally:
        stop.set()
        t.join()
    assert secret[0].read_bytes() == secret[1]


def test_an_append_log_is_never_appended_through_a_link(job: Path, secret: tuple[Path, bytes]) -> None:
    log = job / "stderr.log"
    log.symlink_to(secret[0])
    with open_append(log, root=job) as f:
        f.write(b"line\n")
    assert secret[0].read_bytes() == secret[1]
    assert log.read_bytes() == b"line\n" and not log.is_symlink()
    with open_append(log, root=job) as f:  # an ordinary log is appended to
        f.write(b"two\n")
    assert log.read_bytes() == b"line\ntwo\n"


def test_a_folder_stays_the_one_opened(job: Path, secret: tuple[Path, bytes]) -> None:
    with folder(job / "checkpoints", root=job) as d:
        (job / "checkpoints").rename(job / "moved")
        (job / "checkpoints").symlink_to(secret[0].parent)
        (d / "applied-step").write_text("4")
    assert (job / "moved" / "applied-step").read_text() == "4"
    assert sorted(os.listdir(secret[0].parent)) == ["secret"]


# ---- checkpoints ---------------------------------------------------------------------------------


def test_a_planted_checkpoint_link_is_not_uploaded_and_is_reported(
    job: Path, secret: tuple[Path, bytes], tmp_path: Path
) -> None:
    store = open_storage(url=f"file://{tmp_path / 'store'}", data_dir=tmp_path)
    ckpt = job / "checkpoints"
    (ckpt / "step-00000002.pt").write_bytes(b"real weights")
    (ckpt / "step-00000004.pt").symlink_to(secret[0])
    os.mkfifo(ckpt / "step-00000006.pt")
    assert sorted(local_checkpoints(ckpt)) == ["step-00000002.pt"]
    told: list[str] = []
    up = Uploader([Mirror(storage=store, local=ckpt, prefix=PREFIX)], interval_s=60, report=told.append)
    assert up.sync_all()
    assert store.list(PREFIX) == [f"{PREFIX}/step-00000002.pt"]
    assert any("step-00000004.pt is a symbolic link: not uploaded" in m for m in told), told
    assert any("step-00000006.pt is not a regular file: not uploaded" in m for m in told), told
    up.sync_all()  # told once, not at every sync
    assert len([m for m in told if "step-00000004.pt" in m]) == 1


def test_a_checkpoint_folder_swapped_for_a_link_uploads_nothing(job: Path, tmp_path: Path) -> None:
    # another job's checkpoints on the same host: the planted folder link names them
    other = tmp_path / "jobs" / "7" / "checkpoints"
    other.mkdir(parents=True)
    (other / "step-00000008.pt").write_bytes(b"job 7's weights")
    store = open_storage(url=f"file://{tmp_path / 'store'}", data_dir=tmp_path)
    ckpt = job / "checkpoints"
    ckpt.rmdir()
    ckpt.symlink_to(other)
    told: list[str] = []
    up = Uploader([Mirror(storage=store, local=ckpt, prefix=PREFIX)], interval_s=60, report=told.append)
    up.sync_all()
    assert store.list(PREFIX) == []
    assert any("checkpoints is a symbolic link" in m for m in told), told
    # a restore neither deletes nor writes through it
    Mirror(storage=store, local=ckpt, prefix=PREFIX).restore(applied_step=10)
    assert sorted(os.listdir(other)) == ["step-00000008.pt"]


def test_a_folder_store_never_serves_a_link(job: Path, secret: tuple[Path, bytes], tmp_path: Path) -> None:
    # the default store is the data dir: the API reads a job's checkpoints where its trainer wrote
    store = open_storage(url="", data_dir=tmp_path)
    ckpt = job / "checkpoints"
    (ckpt / "step-00000002.pt").write_bytes(b"real weights")
    (ckpt / "step-00000004.pt").symlink_to(secret[0])
    (ckpt / "pp0").symlink_to(secret[0].parent)
    assert store.list(PREFIX) == [f"{PREFIX}/step-00000002.pt"]
    with store.open_read(f"{PREFIX}/step-00000002.pt") as f:
        assert f.read() == b"real weights"
    from core.storage import StorageError

    for key in (f"{PREFIX}/step-00000004.pt", f"{PREFIX}/pp0/secret"):
        with pytest.raises(StorageError, match="symbolic link"):
            store.open_read(key)
        with pytest.raises(StorageError, match="symbolic link"):
            store.get_bytes(key)
        with pytest.raises(StorageError, match="symbolic link"):
            store.get_file(key, tmp_path / "out")
