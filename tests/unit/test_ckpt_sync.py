"""workers/ckpt_sync.py: the restore rule applied to a store's copies, the uploads that mirror a
trainer's folder, and an upload failure reported and retried. The store is a folder (fast) or a
real S3-API server process (moto's standalone server; production uses S3, MinIO or Ceph)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core import storage
from core.storage import Storage, open_storage
from jobrules.applied import APPLIED_FILE, write_applied_step
from tests.s3 import S3Server
from trainer.checkpoint import prune_checkpoints
from workers.ckpt_sync import Mirror, Uploader, prune_local

PREFIX = "jobs/9/checkpoints"


def _name(step: int) -> str:
    return f"step-{step:08d}.pt"


def _write(folder: Path, steps: dict[str, tuple[int, ...]], tag: bytes = b"x") -> None:
    for piece, at in steps.items():
        for step in at:
            p = folder / piece / _name(step) if piece else folder / _name(step)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(tag * (100 + step))


def _local(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("step-*.pt"))


def _stored(store: Storage) -> list[str]:
    return [k.removeprefix(PREFIX + "/") for k in store.list(PREFIX)]


@pytest.fixture
def store(tmp_path: Path) -> Storage:
    return open_storage(url=f"file://{tmp_path / 'store'}", data_dir=tmp_path / "data")


def test_restore_applies_the_rule_to_the_stores_copies_and_fetches_every_piece(
    store: Storage, tmp_path: Path
) -> None:
    # the last attempt's two ranks (on two hosts) uploaded their pieces; rank 1 died before its
    # step 12, and the database has the lines up to step 12 only (step 16 is past them)
    writer = tmp_path / "writer"
    _write(writer, {"pp0-tp0": (4, 8, 12, 16), "pp1-tp0": (4, 8, 16)})
    Mirror(storage=store, local=writer, prefix=PREFIX).sync()
    # this host's own folder holds a stale piece of an older attempt that the store never got
    host = tmp_path / "host" / "checkpoints"
    _write(host, {"pp1-tp0": (12,)}, tag=b"s")

    restored = Mirror(storage=store, local=host, prefix=PREFIX).restore(applied_step=12)
    assert restored.step == 8 and restored.downloaded == 2
    # the newest whole step at or below 12 is 8; both pieces are fetched (which ranks run here is
    # known only after the rendezvous), and nothing newer is left anywhere to resume from
    assert _local(host) == ["pp0-tp0/step-00000008.pt", "pp1-tp0/step-00000008.pt"]
    assert _stored(store) == [
        "pp0-tp0/step-00000004.pt",
        "pp0-tp0/step-00000008.pt",
        "pp1-tp0/step-00000004.pt",
        "pp1-tp0/step-00000008.pt",
    ]
    assert (host / "pp1-tp0" / _name(8)).read_bytes() == (writer / "pp1-tp0" / _name(8)).read_bytes()

    # a second host restoring now gets the same step: the rule is settled in the store
    other = tmp_path / "host2"
    assert Mirror(storage=store, local=other, prefix=PREFIX).restore(applied_step=12).step == 8
    assert _local(other) == _local(host)


def test_restore_from_an_empty_store_starts_from_nothing(store: Storage, tmp_path: Path) -> None:
    host = tmp_path / "host"
    _write(host, {"": (4,)})  # never uploaded: the store is the truth, so it goes
    assert Mirror(storage=store, local=host, prefix=PREFIX).restore(applied_step=4).step is None
    assert _local(host) == []


def test_sync_uploads_new_and_mirrors_pruned_checkpoints(store: Storage, tmp_path: Path) -> None:
    host = tmp_path / "host"
    mirror = Mirror(storage=store, local=host, prefix=PREFIX)
    _write(host, {"": (4, 8)})
    assert mirror.sync() == 2 and _stored(store) == [_name(4), _name(8)]
    assert mirror.sync() == 0, "what the store holds is not sent again"
    (host / _name(4)).unlink()  # the trainer pruned it (SHARDYARD_CHECKPOINT_KEEP)
    _write(host, {"": (12,)})
    (host / f".{_name(16)}.123.tmp").write_bytes(b"half")  # a write in progress is not uploaded
    assert mirror.sync() == 2 and _stored(store) == [_name(8), _name(12)]

    # a warm-start source: fetched, never pruned, whatever its steps
    reader = Mirror(storage=store, local=tmp_path / "reader", prefix=PREFIX)
    assert reader.restore(applied_step=None, prune=False).step == 12
    assert _stored(store) == [_name(8), _name(12)]


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(log=tmp_path / "moto.log").start()
    server.create_bucket("shardyard")
    try:
        yield server
    finally:
        server.stop()


def _until(pred, timeout: float = 60) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.1)


def test_a_failed_upload_is_reported_retried_and_never_raised(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the hung store is given up on sooner than a deployment's (10 s a request, 30 s an operation):
    # the same client and deadlines, read as the store is opened and as each operation starts
    monkeypatch.setattr(storage, "READ_TIMEOUT_S", 2.0)
    monkeypatch.setattr(storage, "OP_TIMEOUT_S", 6.0)
    store = open_storage(url="s3://shardyard/u", data_dir=tmp_path, endpoint_url=s3.endpoint)
    host = tmp_path / "host"
    told: list[str] = []
    up = Uploader(
        [Mirror(storage=store, local=host, prefix=PREFIX)], interval_s=0.2, report=told.append
    ).start()
    try:
        _write(host, {"": (4,)})
        _until(lambda: _stored(store) == [_name(4)])
        s3.pause()  # a hung store: connections accepted, nothing answers
        _write(host, {"": (8,)})
        _until(lambda: len(told) == 1, timeout=120)
        assert told[0].startswith("checkpoint upload failed, retrying: storage s3://shardyard/u/jobs/9/")
        assert told[0].endswith("upload failed: the store did not answer in time"), told[0]
        s3.resume()
        _until(lambda: len(told) == 2, timeout=90)
        assert told[1] == "checkpoint uploads to s3://shardyard/u work again"
        assert _stored(store) == [_name(4), _name(8)]
    finally:
        assert up.stop(final=True)
    # fenced off: nothing more is written
    fenced = Uploader(
        [Mirror(storage=store, local=host, prefix=PREFIX)],
        interval_s=0.2,
        report=told.append,
        allowed=lambda: False,
    ).start()
    _write(host, {"": (12,)})
    fenced.stop(final=True)
    assert _name(12) not in _stored(store)


def _prune(folder: Path, piece: str, *, keep: int = 3) -> None:
    """The trainer's own pruning of its piece (trainer/checkpoint.py), by the folder's applied step."""
    prune_checkpoints(folder / piece, keep=keep, applied_file=folder / APPLIED_FILE)


def test_a_gangs_pieces_in_the_store_keep_a_whole_step_whichever_node_lags(
    store: Storage, tmp_path: Path
) -> None:
    # a two-node gang, one pipeline stage each, each node on its own disk and uploading its own
    # piece. Both uploaded steps 5 and 10; the database has applied step 10.
    a, b = tmp_path / "a", tmp_path / "b"
    mirrors = {host: Mirror(storage=store, local=host, prefix=PREFIX, pieces=2) for host in (a, b)}
    for host, piece in ((a, "pp0-tp0"), (b, "pp1-tp0")):
        write_applied_step(host, 10, create=True)
        _write(host, {piece: (5, 10)})
        mirrors[host].sync()
    # node a's uploads stall (a slow store, then the node is frozen and killed): its copies stay
    # at 5 and 10 while its trainer goes on with node b's, and the relay keeps up (applied 25)
    _write(a, {"pp0-tp0": (15, 20, 25, 30)})
    _write(b, {"pp1-tp0": (15, 20, 25, 30)})
    for host, piece in ((a, "pp0-tp0"), (b, "pp1-tp0")):
        write_applied_step(host, 25)
        _prune(host, piece)
    assert _local(b) == [f"pp1-tp0/{_name(s)}" for s in (20, 25, 30)], "the folder keeps the newest 3"
    mirrors[b].sync()
    # b's copies of 5 and 10 were pruned in its folder, but 10 is the newest step both pieces
    # hold in the store: b's copy of it (and of the newer ones) stays, 5 goes
    assert _stored(store) == [
        f"pp0-tp0/{_name(5)}",
        f"pp0-tp0/{_name(10)}",
        *(f"pp1-tp0/{_name(s)}" for s in (10, 20, 25, 30)),
    ]

    # the gang is placed again: a new host restores step 10 (whole), not nothing (step 0)
    new = tmp_path / "new"
    restored = Mirror(storage=store, local=new, prefix=PREFIX, pieces=2).restore(applied_step=25)
    assert restored.step == 10
    assert _local(new) == [f"pp0-tp0/{_name(10)}", f"pp1-tp0/{_name(10)}"]


def test_a_pieces_copies_go_once_the_other_pieces_reach_the_store(store: Storage, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    ma, mb = (Mirror(storage=store, local=h, prefix=PREFIX, pieces=2) for h in (a, b))
    for host in (a, b):
        write_applied_step(host, 10, create=True)
    # only b's piece has reached the store yet: with the layout's 2 pieces, nothing is whole
    _write(b, {"pp1-tp0": (5, 10)})
    mb.sync()
    (b / "pp1-tp0" / _name(5)).unlink()
    mb.sync()
    assert _stored(store) == [f"pp1-tp0/{_name(5)}", f"pp1-tp0/{_name(10)}"], "held: nothing is whole"
    _write(a, {"pp0-tp0": (5, 10)})
    ma.sync()
    # 10 is whole in the store now: the held deletion of b's 5 goes at b's next sync
    assert mb.sync() == 1
    assert _stored(store) == [f"pp0-tp0/{_name(s)}" for s in (5, 10)] + [f"pp1-tp0/{_name(10)}"]
    # a removed folder goes whole (a selection's trial)
    shutil.rmtree(b)
    assert mb.sync() == 1 and _stored(store) == [f"pp0-tp0/{_name(s)}" for s in (5, 10)]


def test_at_the_jobs_end_the_folder_and_the_store_keep_the_newest_whole_steps(
    store: Storage, tmp_path: Path
) -> None:
    # a finished two-node gang: the trainers' last saves read an applied step of 10 (the relay
    # was behind), so their folders kept 10..30; the store also holds 5, an older usable copy a
    # restore left there, and node a's deletions of 10 and 15 were held back (b's copies lagged)
    a, b = tmp_path / "a", tmp_path / "b"
    ma, mb = (Mirror(storage=store, local=h, prefix=PREFIX, pieces=2) for h in (a, b))
    _write(a, {"pp0-tp0": (5, 10, 15, 20, 25, 30)})
    _write(b, {"pp1-tp0": (5, 10, 15, 20, 25)})
    ma.sync()
    mb.sync()
    for host in (a, b):
        (host / APPLIED_FILE).write_text("10\n")
    # node a ends first, before b's last piece (30) reached the store: 25 is the newest whole step
    assert prune_local(a, keep=3, applied=30) == [a / "pp0-tp0" / _name(s) for s in (5, 10, 15)]
    assert _local(a) == [f"pp0-tp0/{_name(s)}" for s in (20, 25, 30)]
    # 25 is the newest whole step at or below 30: of the steps below it, the newest 3 whole ones
    # stay (15, 20 and 25), so each piece's 5 and 10 go
    assert ma.prune_store(keep=3, applied=30) == 4
    assert _stored(store) == [
        *(f"pp0-tp0/{_name(s)}" for s in (15, 20, 25, 30)),
        *(f"pp1-tp0/{_name(s)}" for s in (15, 20, 25)),
    ]
    # node b ends last, after its final upload: 30 is whole, the newest 3 whole steps stay
    _write(b, {"pp1-tp0": (30,)})
    mb.sync()
    prune_local(b, keep=3, applied=30)
    mb.prune_store(keep=3, applied=30)
    assert _stored(store) == [f"{piece}/{_name(s)}" for piece in ("pp0-tp0", "pp1-tp0") for s in (20, 25, 30)]
    ma.sync()
    mb.sync()
    assert len(_stored(store)) == 6, "nothing is uploaded again"


def test_at_the_jobs_end_one_file_checkpoints_keep_what_kept_steps_leaves(
    store: Storage, tmp_path: Path
) -> None:
    host = tmp_path / "host"
    m = Mirror(storage=store, local=host, prefix=PREFIX)
    _write(host, {"": (4, 8, 12, 16, 20)})
    m.sync()
    prune_local(host, keep=2, applied=20)
    assert m.prune_store(keep=2, applied=20) == 3
    assert _local(host) == _stored(store) == [_name(16), _name(20)]
    # keep 0 keeps all; a failed job's applied step keeps its floor and what came after it
    _write(host, {"": (24, 28)})
    m.sync()
    assert m.prune_store(keep=0, applied=28) == 0
    assert m.prune_store(keep=1, applied=20) == 1 and _stored(store) == [_name(s) for s in (20, 24, 28)]
