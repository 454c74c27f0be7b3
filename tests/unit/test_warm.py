"""The warm trainer's switch (workers/warm.py): where no run may fork from a zygote, a pool
process's start makes none (it would hold ~300 MiB and import torch for nothing)."""

from __future__ import annotations

import pytest

from core.settings import get_settings
from workers import warm


def test_no_zygote_at_a_pool_process_start_when_warm_runs_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDYARD_WARM_TRAINER", "false")
    get_settings.cache_clear()
    try:
        assert not warm.runs_warm([warm.sys.executable, "-m", "trainer", "--spec", "s.json"])
        warm.prestart()
        assert warm._ZYGOTE.proc is None
    finally:
        warm.shutdown()
        get_settings.cache_clear()
