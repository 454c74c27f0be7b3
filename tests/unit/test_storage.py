"""core/storage.py on its three kinds of store: the data dir itself (the default: keys are the
very files the services used before, nothing copied), a folder (file:///...), and an S3 store
served by a real S3-API server process that the test starts (moto's standalone server; production
uses AWS S3, MinIO or Ceph, through the same s3fs code)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.settings import Settings
from core.storage import KeyMissing, Storage, StorageError, get_storage, open_storage
from tests.s3 import S3Server


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(log=tmp_path_factory.mktemp("moto") / "moto.log").start()
    server.create_bucket("shardyard")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["folder", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "folder":
        return open_storage(url=f"file://{tmp_path / 'store'}", data_dir=tmp_path / "data")
    server: S3Server = request.getfixturevalue("s3")
    # a prefix per test: the server (and its bucket) is shared by the module
    return open_storage(
        url=f"s3://shardyard/{request.node.name.replace('[', '-').rstrip(']')}",
        data_dir=tmp_path / "data",
        endpoint_url=server.endpoint,
    )


def test_put_get_list_delete_round_trip(store: Storage, tmp_path: Path) -> None:
    assert not store.is_data_dir
    store.check()
    src = tmp_path / "ckpt.pt"
    src.write_bytes(b"\x00weights" * 1000)
    store.put_file("jobs/7/checkpoints/pp0-tp0/step-00000004.pt", src)
    store.put_file("jobs/7/checkpoints/pp1-tp0/step-00000004.pt", src)
    store.put_bytes("jobs/70/checkpoints/step-00000001.pt", b"other job")
    # a prefix is a folder: jobs/7 does not take in jobs/70
    assert store.list("jobs/7") == [
        "jobs/7/checkpoints/pp0-tp0/step-00000004.pt",
        "jobs/7/checkpoints/pp1-tp0/step-00000004.pt",
    ]
    assert store.list("jobs/8") == []
    assert store.exists("jobs/70/checkpoints/step-00000001.pt")
    assert not store.exists("jobs/70/checkpoints/step-00000002.pt")

    dest = tmp_path / "restored" / "step-00000004.pt"
    store.get_file("jobs/7/checkpoints/pp1-tp0/step-00000004.pt", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == [dest.name], "no temporary file is left beside it"
    assert store.get_bytes("jobs/70/checkpoints/step-00000001.pt") == b"other job"

    assert store.delete_prefix("jobs/7") == 2
    assert store.list("jobs/7") == []
    assert store.list("jobs") == ["jobs/70/checkpoints/step-00000001.pt"], "another job's keys stay"
    store.delete("jobs/70/checkpoints/step-00000001.pt")
    store.delete("jobs/70/checkpoints/step-00000001.pt")  # gone already: not an error
    assert store.list("jobs") == []


def test_a_missing_key_is_named(store: Storage, tmp_path: Path) -> None:
    with pytest.raises(KeyMissing) as err:
        store.get_file("workspaces/abc.tar.gz", tmp_path / "ws.tar.gz")
    assert str(err.value).startswith(f"storage {store.url}/workspaces/abc.tar.gz: download failed")
    assert not (tmp_path / "ws.tar.gz").exists()
    with pytest.raises(KeyMissing):
        store.get_bytes("workspaces/abc.tar.gz")


@pytest.mark.parametrize("key", ["../etc/passwd", "/abs", "jobs//1", "jobs/./1", ""])
def test_keys_stay_inside_the_store(tmp_path: Path, key: str) -> None:
    store = open_storage(url=f"file://{tmp_path}", data_dir=tmp_path / "data")
    for op in (lambda: store.put_bytes(key, b"x"), lambda: store.list(key), lambda: store.delete(key)):
        with pytest.raises(ValueError, match="storage key"):
            op()


def test_the_default_store_is_the_data_dir_itself(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = get_storage(Settings(data_dir=data, storage_url=""))
    assert store.is_data_dir and store.local
    store.put_bytes("workspaces/d.zip", b"zip")
    # the same file the API wrote before there was a store: nothing is copied anywhere
    assert (data / "workspaces" / "d.zip").read_bytes() == b"zip"
    assert (
        store.local_path("jobs/3/checkpoints/step-00000001.pt")
        == data / "jobs/3/checkpoints/step-00000001.pt"
    )
    assert open_storage(url=f"file://{data}", data_dir=data).is_data_dir, "file:// naming the data dir"


def test_unknown_schemes_are_refused(tmp_path: Path) -> None:
    for url, rule in [("gs://b", "use an empty value"), ("file://rel/x", "absolute"), ("s3://", "bucket")]:
        with pytest.raises(ValueError, match=rule):
            open_storage(url=url, data_dir=tmp_path)


def test_an_unreachable_s3_store_answers_within_seconds_naming_itself(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = open_storage(url="s3://shardyard/x", data_dir=tmp_path, endpoint_url=f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        store.list("jobs/1/checkpoints")
    assert time.monotonic() - t0 < 30, "botocore's defaults would retry for minutes"
    assert not isinstance(err.value, KeyMissing), "unreachable is not 'nothing there'"
    msg = str(err.value)
    assert msg.startswith("storage s3://shardyard/x/jobs/1/checkpoints/: list failed: ")
    assert "Could not connect" in msg, msg
    with pytest.raises(StorageError, match="reach the store failed"):
        store.check()


def test_a_missing_bucket_is_named(s3: S3Server, tmp_path: Path) -> None:
    store = open_storage(url="s3://no-such-bucket/p", data_dir=tmp_path, endpoint_url=s3.endpoint)
    with pytest.raises(
        StorageError, match="s3://no-such-bucket/p: reach the store failed: .*bucket does not exist"
    ):
        store.check()


def test_a_listing_holds_objects_only(s3: S3Server, tmp_path: Path) -> None:
    """A "folder/" marker object (an S3 console's "create folder", some sync tools) is not a key:
    a checkpoint listing that took it in named a folder as a file (and the store gang test's own
    listing failed to parse it; s3fs's find answers the folder itself the same way when its
    listing races a first upload)."""
    store = open_storage(url="s3://shardyard/markers", data_dir=tmp_path, endpoint_url=s3.endpoint)
    store.fs.pipe_file("shardyard/markers/jobs/5/checkpoints/", b"")
    assert store.list("jobs/5/checkpoints") == [] and store.sizes("jobs/5") == {}
    store.put_bytes("jobs/5/checkpoints/pp0-tp0/step-00000005.pt", b"piece")
    assert store.list("jobs/5") == ["jobs/5/checkpoints/pp0-tp0/step-00000005.pt"]
    assert store.sizes("jobs/5/checkpoints") == {"jobs/5/checkpoints/pp0-tp0/step-00000005.pt": 5}
