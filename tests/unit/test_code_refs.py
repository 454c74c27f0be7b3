"""The worker runs a workspace only for its owner, named by its digest: a spec written past the
API (a tampered row, a request stored before specs were pinned) that names another user's bytes,
or a workspace by id, is refused with the reason the job fails with; and a search space may not
vary the code or environment its trials run."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from core.settings import Settings
from core.storage import get_storage, workspace_key
from db import jobs as db_jobs
from db import selections as db_sel
from db import users as db_users
from db import workspaces as db_ws
from db.connection import session_for
from db.migrate import upgrade
from jobrules.space import KNOWN_PATHS, SpaceError, parse_space
from tests.archives import targz
from workers.search import _owned_base
from workers.workspace import WorkspaceRefused, unpack_workspace


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    url = f"sqlite:///{tmp_path / 'refs.db'}"
    upgrade(url)
    return Settings(database_url=url, data_dir=tmp_path / "data")


def _stored_workspace(settings: Settings, *, owner_id: int, files: dict[str, bytes]) -> str:
    """A workspace row of `owner_id` with its archive in the store, as an upload leaves it; its ref."""
    blob = targz(files)
    digest = hashlib.sha256(blob).hexdigest()
    path = get_storage(settings).local_path(workspace_key(digest, "tar.gz"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    with session_for(settings.database_url) as s:
        db_ws.add_workspace(s, digest=digest, size=len(blob), name="ws", format="tar.gz", owner_id=owner_id)
    return f"sha256:{digest}"


def _users(settings: Settings) -> tuple[int, int]:
    with session_for(settings.database_url) as s:
        return db_users.create_user(s, name="alice").id, db_users.create_user(s, name="bob").id


def _job(settings: Settings, *, owner_id: int, spec: dict) -> Path:
    """A job row written straight to the database (as a tampered spec would be), and its folder."""
    with session_for(settings.database_url) as s:
        job = db_jobs.create_job(s, name="j", spec=spec, steps=3, owner_id=owner_id)
    workdir = settings.data_dir / "jobs" / str(job.id)
    workdir.mkdir(parents=True)
    return workdir


def test_a_spec_naming_another_users_workspace_is_refused_by_the_worker(settings: Settings) -> None:
    alice, bob = _users(settings)
    bobs = _stored_workspace(settings, owner_id=bob, files={"secret.txt": b"bob's data"})
    workdir = _job(settings, owner_id=alice, spec={"workspace": bobs})
    dest = unpack_workspace(bobs, settings=settings, workdir=workdir)
    # nothing of bob's reaches alice's job folder, and the job fails with the reason
    assert dest is not None and not dest.exists()
    why = (workdir / "workspace.error").read_text()
    assert "refused" in why and f"user {alice}" in why and "only its owner's workspaces" in why, why
    # a node folder of a gang is its job's too
    node = workdir / "node-1"
    node.mkdir()
    assert not unpack_workspace(bobs, settings=settings, workdir=node).exists()
    assert "refused" in (node / "workspace.error").read_text()


def test_the_owner_runs_their_own_bytes_and_ids_are_never_resolved(settings: Settings) -> None:
    alice, bob = _users(settings)
    mine = _stored_workspace(settings, owner_id=alice, files={"model.py": b"X = 1\n"})
    workdir = _job(settings, owner_id=alice, spec={"workspace": mine})
    dest = unpack_workspace(mine, settings=settings, workdir=workdir)
    assert dest is not None and (dest / "model.py").read_bytes() == b"X = 1\n"
    # the same bytes uploaded by bob are bob's row: alice's job still runs on her own
    with session_for(settings.database_url) as s:
        row = db_ws.owned_workspace(s, mine, owner_id=alice)
        assert row.owner_id == alice
    # an id is a row number anyone can count to: the worker resolves digests only, even the owner's
    workdir = _job(settings, owner_id=alice, spec={"workspace": str(row.id)})
    assert not unpack_workspace(str(row.id), settings=settings, workdir=workdir).exists()
    assert "by id" in (workdir / "workspace.error").read_text()
    # a folder that is no job's or batch's is refused: whose code it may run is unknown
    stray = settings.data_dir / "elsewhere"
    stray.mkdir(parents=True)
    assert not unpack_workspace(mine, settings=settings, workdir=stray).exists()
    assert "not the folder of a known job" in (stray / "workspace.error").read_text()


def test_a_batch_runs_and_grows_only_on_its_owners_workspace(settings: Settings) -> None:
    alice, bob = _users(settings)
    bobs = _stored_workspace(settings, owner_id=bob, files={"secret.txt": b"bob's data"})
    with session_for(settings.database_url) as s:
        sel = db_sel.create_selection(
            s,
            name="sel",
            request={"base": {"workspace": bobs}, "method": "tpe", "trials": 4, "space": {"train.lr": [0.1]}},
            metric="val_loss",
            mode="min",
            scheduler="fifo",
            owner_id=alice,
        )
        # a sampler's next trials are made from the stored base: refused, so the search stops
        with pytest.raises(WorkspaceRefused, match="only its owner's workspaces"):
            _owned_base(s, sel=sel, req=sel.request)
        sid = sel.id
    root = settings.data_dir / "selections" / str(sid)
    root.mkdir(parents=True)
    assert not unpack_workspace(bobs, settings=settings, workdir=root).exists()
    assert "refused" in (root / "workspace.error").read_text()


@pytest.mark.parametrize("path", ["workspace", "env", "env.pip", "env.pip.0"])
def test_code_and_environment_are_not_searchable(path: str) -> None:
    assert path not in KNOWN_PATHS
    with pytest.raises(SpaceError) as e:
        parse_space({path: ["1", "2"]})
    assert f"space path {path!r} may not be searched" in str(e.value)
    assert "fixed for the whole batch" in str(e.value)


@pytest.mark.parametrize("planted", ["workspace", "workspace/tree"])
def test_a_workspace_left_as_a_link_by_a_trainer_is_unpacked_again_not_followed(
    settings: Settings, tmp_path: Path, planted: str
) -> None:
    """An earlier attempt's trainer (its folder is writable) leaves `workspace`, or `tree` below a
    spare's placeholder, as a link to a folder outside: the next attempt unpacks its own bytes
    there and never reuses, or binds into its sandbox, what the link names."""
    alice, _ = _users(settings)
    mine = _stored_workspace(settings, owner_id=alice, files={"model.py": b"X = 1\n"})
    workdir = _job(settings, owner_id=alice, spec={"workspace": mine})
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not the job's")
    link = workdir / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside)
    dest = unpack_workspace(mine, settings=settings, workdir=workdir)
    assert dest is not None and not dest.is_symlink() and dest.resolve().is_relative_to(workdir.resolve())
    assert (dest / "model.py").read_bytes() == b"X = 1\n" and not (dest / "secret.txt").exists()
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
