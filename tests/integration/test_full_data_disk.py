"""A full data disk under a running API: the stack's whole root (the SQLite database, the logs,
redis' folder) is a small tmpfs, filled to the last byte while the API runs. Writes must answer
503 with the database's reason, reads, /api/health and /metrics must keep answering, and the API
process must live: its Prometheus multiprocess files are memory-mapped, and where they lived in
the data dir a new series written into an unbacked page killed the API with SIGBUS
(core/multiproc.py keeps them in a runtime folder in memory). Needs permission to mount (root
here); skipped without it."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.stack import Stack
from core.multiproc import MULTIPROC_ENV
from tests.conftest import TINY_SPEC, StackHandle, running
from tests.fullfs import full_disk

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def disk_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StackHandle, Path]]:
    root = tmp_path_factory.mktemp("full-data-disk") / "data"
    try:
        cm = full_disk(root, size_kib=32 * 1024)
        mount = cm.__enter__()
    except RuntimeError as e:
        pytest.skip(f"no full disk to inject here: {e}")
    try:
        # no worker: the API and its embedded scheduler are what a full disk must not kill
        with running(Stack(root=mount, workers=0)) as handle:
            yield handle, mount
    finally:
        cm.__exit__(None, None, None)


def _fill(where: Path) -> Path:
    """Write zeros into `where` until the disk refuses a byte (ENOSPC)."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 4096, 1):  # big blocks, then the last pages and bytes
            while True:
                try:
                    if os.write(fd, b"\0" * size) < size:
                        break
                except OSError:
                    break
    finally:
        os.close(fd)
    return filler


def test_the_multiprocess_folder_is_private_and_off_the_data_disk(
    disk_stack: tuple[StackHandle, Path],
) -> None:
    h, mount = disk_stack
    folder = h.stack.multiproc_dir
    if os.environ.get(MULTIPROC_ENV):
        pytest.skip(f"{MULTIPROC_ENV} is set for the whole run")
    assert folder is not None and folder.is_dir()
    assert not folder.resolve().is_relative_to(mount.resolve()), folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert any(folder.glob("*.db")), "the API's processes write their values there"


def test_a_full_data_disk_gives_503s_and_a_live_api(disk_stack: tuple[StackHandle, Path]) -> None:
    h, mount = disk_stack
    assert h.client.get("/api/jobs").status_code == 200
    filler = _fill(mount)
    try:
        # a job's write needs pages the disk no longer has: 503 with the database's reason
        refused = h.client.post("/api/jobs", json={**TINY_SPEC, "name": "no-room"})
        assert refused.status_code == 503, refused.text
        assert "full" in refused.json()["detail"], refused.text
        # reads of many routes, each a new latency series in the API's instruments (new pages of
        # the mapped files), and /metrics that sums them
        paths = ["/api/selections", "/api/health", "/api/queue", "/api/users", "/api/tokens"]
        paths += ["/api/auth/me", "/api/webhooks", "/api/jobs/999999", "/api/selections/999999", "/"]
        for path in paths:
            got = h.client.get(path)
            assert got.status_code < 500, (path, got.status_code, got.text[:300])
        for _ in range(3):
            metrics = h.client.get("/metrics")
            assert metrics.status_code == 200, metrics.text[:300]
            assert 'route="/api/webhooks"' in metrics.text, metrics.text[:300]
        assert h.stack.procs["api"].poll() is None, "the API process died"
    finally:
        filler.unlink()
    # room again: the same write goes through
    ok = h.client.post("/api/jobs", json={**TINY_SPEC, "name": "room-again"})
    assert ok.status_code == 201, ok.text
    assert h.stack.procs["api"].poll() is None
