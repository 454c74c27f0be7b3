"""A pipeline job run through trainer.runner.run on real gloo ranks gives the single-process run's
losses on the same job."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from jobrules.spec import SpecError
from tests.gloo import run_ranks
from tests.trainer.stops import StopAfter
from trainer.config import load_job
from trainer.protocol import ListSink, NeverStop
from trainer.runner import run


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


def _run(rank: int, world: int, schedules: tuple[str, ...], ckpt: str) -> dict[str, dict]:
    out = {}
    for name in schedules:
        sink = ListSink()
        result = run(load_job(_spec(name)), sink=sink, stop=NeverStop())
        out[name] = {
            "metrics": sink.metrics,
            "events": sink.events,
            "results": sink.results,
            "result": result,
        }
    # resume: two steps with a checkpoint after each, then the same job to three steps
    spec = _spec("chimera")
    spec["train"]["steps"], spec["checkpoint_every"] = 2, 1
    first = ListSink()
    run(load_job(spec), sink=first, stop=NeverStop(), checkpoint_dir=Path(ckpt))
    spec["train"]["steps"] = 3
    second = ListSink()
    run(load_job(spec), sink=second, stop=NeverStop(), checkpoint_dir=Path(ckpt))
    out["resume"] = {"first": first.metrics, "second": second.metrics, "logs": second.logs}
    stopped = ListSink()
    result = run(load_job(_spec("async")), sink=stopped, stop=StopAfter(2))
    out["stop"] = {"metrics": stopped.metrics, "result": result}
    return out


@functools.cache
def _runs() -> list[dict[str, dict]]:
    with tempfile.TemporaryDirectory() as ckpt:
        return run_ranks(_run, world_size=2, args=(SCHEDULES, ckpt), timeout_s=240)


@functools.cache
def _reference() -> ListSink:
    sink = ListSink()
    spec = _spec("1f1b")
    del spec["parallel"]
    run(load_job(spec), sink=sink, stop=NeverStop())
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


@pytest.mark.slow
def test_resumed_pipeline_job_continues_the_loss_curve() -> None:
    ref = _reference().series("loss")
    lead = _runs()[0]["resume"]
    first = [v for _, n, v in lead["first"] if n == "loss"]
    second = [(s, v) for s, n, v in lead["second"] if n == "loss"]
    torch.testing.assert_close(first, ref[:2], rtol=1e-4, atol=1e-5)
    assert [s for s, _ in second] == [3]
    torch.testing.assert_close(second[0][1], ref[2], rtol=1e-4, atol=1e-5)
    assert any(m.endswith("at step 2") and m.startswith("resumed from") for m in lead["logs"])


@pytest.mark.slow
def test_stop_signal_ends_every_rank_at_the_same_step() -> None:
    lead, other = _runs()[0]["stop"], _runs()[1]["stop"]
    assert [s for s, n, _ in lead["metrics"] if n == "loss"] == [1, 2]
    assert lead["result"]["stopped"] and lead["result"]["steps"] == 2
    assert other["result"]["stopped"] and other["result"]["steps"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path on a machine without a GPU")
def test_cuda_pipeline_jobs_are_no_longer_refused() -> None:
    """The NCCL refusal is gone (the driver sends untagged messages in a checked order): the spec
    is accepted, and a CUDA pipeline job gets as far as the launch check (run here on one process,
    not under torchrun with one rank per stage)."""
    spec = _spec("1f1b")
    spec["resources"]["device"] = "cuda"
    job = load_job(spec)
    with pytest.raises(SpecError, match=r"needs pp\*dp\*tp = 2\*1\*1 = 2 processes but WORLD_SIZE is 1"):
        run(job, sink=ListSink(), stop=NeverStop())
