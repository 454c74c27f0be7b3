"""A stop asked on any rank stops every rank at the same step (trainer/protocol.py should_stop).

A multi-node job has one stop file per node (workers/gang.py): a cancel, a preemption or a warm
shutdown of one worker touches only its own, and global rank 0 may be on another node. Real gloo
ranks; the same one all-reduce runs on NCCL with the flag on the rank's GPU."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gloo import run_ranks
from trainer.config import load_job
from trainer.protocol import ListSink
from trainer.runner import run

pytestmark = pytest.mark.slow


class StopOnRank:
    """Asks to stop after `checks` step boundaries, on rank `rank` only (its node's stop file)."""

    def __init__(self, *, me: int, rank: int, checks: int) -> None:
        self.me, self.rank, self.checks, self.calls = me, rank, checks, 0

    def requested(self) -> bool:
        self.calls += 1
        return self.me == self.rank and self.calls > self.checks


def _run(rank: int, _world: int) -> dict[str, Any]:
    job = load_job(
        {
            "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 2, "seq_len": 16},
            "data": {"max_chars": 50_000},
            "train": {"steps": 10, "batch_size": 4, "lr": 3e-3, "eval_every": 10, "seed": 0},
            "parallel": {"data_parallel": 2},
        }
    )
    return run(job, sink=ListSink(), stop=StopOnRank(me=rank, rank=1, checks=3))


def test_a_stop_asked_on_rank_1_alone_stops_both_ranks_at_one_step() -> None:
    results = run_ranks(_run, world_size=2)
    assert [(r["stopped"], r["steps"]) for r in results] == [(True, 3), (True, 3)]
