"""The same stack on PostgreSQL: only the database URL changes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from api.stack import Stack
from tests.conftest import TINY_SPEC, StackHandle

pytestmark = pytest.mark.integration


def test_a_job_runs_end_to_end_on_postgres(pg_server: str, tmp_path: Path) -> None:
    with Stack(root=tmp_path, database_url=pg_server) as st:
        handle = StackHandle(st)
        assert httpx.get(f"{st.base_url}/api/health").json()["db"]["url"].startswith("127.0.0.1")
        job = handle.submit(
            {**TINY_SPEC, "name": "on-postgres", "train": {**TINY_SPEC["train"], "steps": 12}}
        )
        done = handle.wait(job["id"], timeout=180)
        assert done["attempts"] == 1
        loss = handle.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss"}).json()
        assert loss["series"]["loss"]["steps"] == list(range(1, 13))
        handle.client.close()
