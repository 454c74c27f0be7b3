"""train_pipeline on real gloo ranks gives trainer.loop.train's losses on the same job."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.gloo import run_ranks
from trainer.config import JobConfig
from trainer.loop import train
from trainer.pipeline.job import train_pipeline
from trainer.protocol import ListSink, NeverStop


def _spec(schedule: str, *, stages: int = 2, microbatches: int = 4) -> dict:
    return {
        "name": f"pp-{schedule}",
        "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 16},
        "data": {"max_chars": 20000},
        "train": {
            "steps": 3,
            "batch_size": 8,
            "lr": 3e-3,
            "optimizer": "adamw",
            "eval_every": 2,
            "eval_batches": 2,
        },
        "parallel": {"pipeline": {"stages": stages, "microbatches": microbatches, "schedule": schedule}},
        "resources": {"device": "cpu"},
    }


SCHEDULES = ("1f1b", "chimera-zb", "async")


def _run(rank: int, world: int, schedules: tuple[str, ...]) -> dict[str, dict]:
    out = {}
    for name in schedules:
        sink = ListSink()
        result = train_pipeline(JobConfig.from_dict(_spec(name)), sink=sink, stop=NeverStop())
        out[name] = {
            "metrics": sink.metrics,
            "events": sink.events,
            "results": sink.results,
            "result": result,
        }
    return out


@functools.cache
def _runs() -> list[dict[str, dict]]:
    return run_ranks(_run, world_size=2, args=(SCHEDULES,), timeout_s=240)


@functools.cache
def _reference() -> ListSink:
    sink = ListSink()
    spec = _spec("1f1b")
    del spec["parallel"]
    train(JobConfig.from_dict(spec), sink=sink, stop=NeverStop())
    return sink


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_job_matches_the_single_process_loop(schedule: str) -> None:
    ref = _reference()
    lead, other = _runs()[0][schedule], _runs()[1][schedule]
    got = ListSink()
    got.metrics = lead["metrics"]
    torch.testing.assert_close(got.series("loss"), ref.series("loss"), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.series("val_loss"), ref.series("val_loss"), rtol=1e-4, atol=1e-5)
    assert [s for s, n, _ in lead["metrics"] if n == "val_loss"] == [2, 3]
    for name in ("step_time_ms", "tokens_per_s", "peak_mem_mb"):
        assert len(got.series(name)) == 3
    # only rank 0 reports
    assert other["metrics"] == [] and other["events"] == [] and other["results"] == []
    assert lead["results"] == [lead["result"]] and lead["result"]["steps"] == 3
    assert lead["result"]["final_loss"] == pytest.approx(ref.series("loss")[-1], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_timeline_event_carries_executed_and_simulated_runs(schedule: str) -> None:
    lead = _runs()[0][schedule]
    timelines = [d for e, d in lead["events"] if e == "timeline"]
    assert [t["step"] for t in timelines] == [2, 3]
    ev = timelines[-1]
    assert (ev["schedule"], ev["stages"], ev["microbatches"]) == (schedule, 2, 4)
    keys = {"rank", "op", "mb", "stage", "replica", "start", "end"}
    n_ops = 3 if schedule == "chimera-zb" else 2
    for part in ("executed", "simulated"):
        compute = [e for e in ev[part] if e["op"] != "AR"]
        assert all(set(e) == keys for e in ev[part])
        assert len(compute) == n_ops * 2 * 4, part
        assert {e["rank"] for e in compute} == {0, 1}
        assert all(0 <= e["start"] <= e["end"] for e in ev[part])
    if schedule.startswith("chimera"):
        assert {e["op"] for e in ev["executed"]} >= {"AR"}
    assert 0.0 <= ev["bubble_executed"] < 1.0 and 0.0 <= ev["bubble_simulated"] < 1.0
