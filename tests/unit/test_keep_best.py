"""`checkpoints: best` across a batch's groups (workers/keep_best.py): nothing is removed while a
trial runs; once all have ended, only the best trial's directory stays (the batch's mode decides),
whichever group wrote it; `all` keeps every one."""

from __future__ import annotations

from pathlib import Path

from core.settings import Settings
from db import selections as dbs
from db.connection import session_for
from workers.keep_best import keep_best_checkpoints


def _batch(db_url: str, *, mode: str, checkpoints: str) -> int:
    with session_for(db_url) as s:
        sel = dbs.create_selection(
            s, name="b", request={"checkpoints": checkpoints}, metric="val_loss", mode=mode, scheduler="x"
        )
        dbs.add_trials(
            s, selection_id=sel.id, plans=[(i, {}, {"train": {"steps": 4}}) for i in range(3)], queue="cpu"
        )
        return sel.id


def _set(db_url: str, sid: int, states: dict[int, tuple[str, float | None]]) -> None:
    with session_for(db_url) as s:
        for t in dbs.get_selection(s, sid).trials:
            t.status, t.best_metric = states[t.index]
        s.commit()


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("trial-*"))


def test_only_the_best_trial_of_an_ended_batch_keeps_its_directory(db_url: str, tmp_path: Path) -> None:
    settings = Settings(database_url=db_url, data_dir=tmp_path)
    sid = _batch(db_url, mode="max", checkpoints="best")
    root = tmp_path / "selections" / str(sid)
    for i in range(3):  # as three groups left them: each kept its own trial
        (root / f"trial-{i}").mkdir(parents=True)
        (root / f"trial-{i}" / "step-4.pt").write_bytes(b"x")

    _set(db_url, sid, {0: ("succeeded", 1.0), 1: ("running", 3.0), 2: ("failed", None)})
    with session_for(db_url) as s:
        assert keep_best_checkpoints(settings, s, selection_id=sid) == []
    assert _dirs(root) == ["trial-0", "trial-1", "trial-2"]

    _set(db_url, sid, {0: ("succeeded", 1.0), 1: ("succeeded", 3.0), 2: ("failed", None)})
    with session_for(db_url) as s:
        assert dbs.kept_trial(s, selection_id=sid) == 1  # mode max: 3.0 beats 1.0
        removed = keep_best_checkpoints(settings, s, selection_id=sid)
    assert sorted(p.name for p in removed) == ["trial-0", "trial-2"]
    assert _dirs(root) == ["trial-1"] and (root / "trial-1" / "step-4.pt").exists()
    with session_for(db_url) as s:  # a second worker ending a group at the same moment: nothing more
        assert keep_best_checkpoints(settings, s, selection_id=sid) == []
    assert _dirs(root) == ["trial-1"]


def test_checkpoints_all_keeps_every_trial(db_url: str, tmp_path: Path) -> None:
    settings = Settings(database_url=db_url, data_dir=tmp_path)
    sid = _batch(db_url, mode="min", checkpoints="all")
    root = tmp_path / "selections" / str(sid)
    for i in range(3):
        (root / f"trial-{i}").mkdir(parents=True)
    _set(db_url, sid, {0: ("succeeded", 1.0), 1: ("succeeded", 3.0), 2: ("stopped", 2.0)})
    with session_for(db_url) as s:
        assert dbs.kept_trial(s, selection_id=sid) == 0  # mode min
        assert keep_best_checkpoints(settings, s, selection_id=sid) == []
    assert _dirs(root) == ["trial-0", "trial-1", "trial-2"]


def test_the_store_keeps_only_the_best_trial_too(db_url: str, tmp_path: Path) -> None:
    """With a store that is not the data dir (a folder here; S3 goes through the same calls), the
    trials' copies that other workers uploaded are removed there, whatever this worker's disk holds."""
    store_dir = tmp_path / "store"
    settings = Settings(database_url=db_url, data_dir=tmp_path / "data", storage_url=f"file://{store_dir}")
    sid = _batch(db_url, mode="min", checkpoints="best")
    for i in range(3):  # uploaded by three workers; none of it on this one's disk
        (store_dir / "selections" / str(sid) / f"trial-{i}").mkdir(parents=True)
        (store_dir / "selections" / str(sid) / f"trial-{i}" / "step-00000004.pt").write_bytes(b"x")
    (store_dir / "selections" / str(sid + 1) / "trial-0").mkdir(parents=True)  # another batch's
    _set(db_url, sid, {0: ("succeeded", 2.0), 1: ("succeeded", 1.0), 2: ("failed", None)})
    with session_for(db_url) as s:
        keep_best_checkpoints(settings, s, selection_id=sid)
    assert _dirs(store_dir / "selections" / str(sid)) == ["trial-1"]
    assert (store_dir / "selections" / str(sid) / "trial-1" / "step-00000004.pt").exists()
    assert _dirs(store_dir / "selections" / str(sid + 1)) == ["trial-0"]
