"""Admission of a selection batch's groups against the live workers' inventories: a group asks the
queue its trials' spec puts it on, as the scheduler places it (a real SQLite database, migrated)."""

from __future__ import annotations

from pathlib import Path

from api.admission import group_problem
from core.settings import Settings
from db.connection import session_for
from db.migrate import upgrade
from db.models import User
from db.workers import record_heartbeat
from jobrules.spec import parse_job
from tests.conftest import TINY_SPEC

GPU_SPEC = {**TINY_SPEC, "resources": {"device": "cuda", "gpus": 1}}


def _gpu_only_fleet(url: str) -> None:
    """One worker that serves only the gpu queue: two CUDA devices, two slots, 64 GiB."""
    with session_for(url) as s:
        record_heartbeat(
            s,
            name="g1",
            hostname="h",
            queues=["gpu"],
            devices=[{"type": "cuda"}, {"type": "cuda"}],
            host={"slots": 2, "tasks": 1, "ram_bytes": 64 * 2**30, "cpus": 8},
        )
        s.commit()


def test_a_gpu_batch_fits_a_worker_that_serves_only_the_gpu_queue(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'test.db'}"
    upgrade(url)
    _gpu_only_fleet(url)
    settings = Settings(data_dir=tmp_path)
    ann = User(name="ann")
    gpu = parse_job(GPU_SPEC).model_dump()
    cpu = parse_job(TINY_SPEC).model_dump()
    with session_for(url) as s:
        # the group's queue follows its trials' resources: gpu, which the worker serves
        assert (
            group_problem(s, specs=[gpu, gpu], devices=2, group_size=2, settings=settings, user=ann) is None
        )
        # a CPU batch's group asks the cpu queue, which no live worker serves: refused, naming devices
        why = group_problem(s, specs=[cpu, cpu], devices=2, group_size=2, settings=settings, user=ann)
    assert why is not None and why.startswith("devices: each group of the batch runs as one process"), why
