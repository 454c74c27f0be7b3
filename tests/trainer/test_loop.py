"""The single-process loop on real text: it learns, it resumes on the same trajectory, it stops."""

from __future__ import annotations

from pathlib import Path

import torch

from jobrules.spec import DataSpec, JobSpec
from tests.trainer.stops import StopAfterLosses
from trainer.config import load_job
from trainer.data import TextData, decode
from trainer.protocol import ListSink, NeverStop
from trainer.runner import run


def tiny(**train) -> JobSpec:
    return load_job(
        {
            "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 32},
            "data": {"max_chars": 200_000},
            "train": {"steps": 40, "batch_size": 8, "lr": 3e-3, "eval_every": 20, **train},
        }
    )


def test_the_corpus_is_real_python_source() -> None:
    data = TextData.from_config(DataSpec(max_chars=200_000), seq_len=16)
    text = decode(data.train[:20_000].tolist())
    assert "def " in text and "import " in text
    assert len(data.val) >= 0.09 * (len(data.train) + len(data.val))


def test_loss_falls_on_real_text() -> None:
    sink = ListSink()
    result = run(tiny(), sink=sink, stop=NeverStop())
    loss = sink.series("loss")
    assert len(loss) == 40 and result["steps"] == 40
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.7
    val = sink.series("val_loss")
    assert len(val) == 2 and val[1] < val[0]
    assert {"tokens_per_s", "step_time_ms", "peak_mem_mb"} <= {n for _, n, _ in sink.metrics}


def test_resume_from_checkpoint_continues_the_same_trajectory(tmp_path: Path) -> None:
    straight = ListSink()
    run(tiny(), sink=straight, stop=NeverStop())

    first = ListSink()
    job = tiny()
    job.checkpoint_every = 10
    result = run(job, sink=first, stop=StopAfterLosses(first, 17), checkpoint_dir=tmp_path)
    assert result["stopped"] and result["steps"] == 17
    # the stop saved step 17; drop it to resume from the periodic checkpoint at step 10
    (tmp_path / "step-00000017.pt").unlink()
    second = ListSink()
    run(job, sink=second, stop=NeverStop(), checkpoint_dir=tmp_path)
    assert second.logs[0] == "resumed from step-00000010.pt at step 10"
    resumed = [v for s, n, v in second.metrics if n == "loss"]
    torch.testing.assert_close(resumed, straight.series("loss")[10:], rtol=1e-5, atol=1e-6)


def test_sgd_and_adamw_both_train() -> None:
    for opt in ("sgd", "adamw"):
        sink = ListSink()
        run(
            tiny(optimizer=opt, lr=0.05 if opt == "sgd" else 3e-3, momentum=0.9, steps=20),
            sink=sink,
            stop=NeverStop(),
        )
        loss = sink.series("loss")
        assert loss[-1] < loss[0], opt


def test_a_finished_run_resumed_again_re_emits_its_result_and_no_metrics(tmp_path: Path) -> None:
    """A worker that died between the trainer's exit and its final status write runs the job again
    from the last checkpoint: the same `result` comes out, and no metric step is written twice."""
    job = tiny(steps=4, eval_every=2)
    first = ListSink()
    result = run(job, sink=first, stop=NeverStop(), checkpoint_dir=tmp_path)
    assert result["steps"] == 4 and first.series("val_loss")
    again = ListSink()
    assert run(job, sink=again, stop=NeverStop(), checkpoint_dir=tmp_path) == result
    assert again.results == [result] and again.metrics == []


def test_a_stopped_run_resumed_with_an_immediate_stop_keeps_its_last_losses(tmp_path: Path) -> None:
    job = tiny(steps=6, eval_every=2)
    first = ListSink()
    r1 = run(job, sink=first, stop=StopAfterLosses(first, 3), checkpoint_dir=tmp_path)
    assert r1["steps"] == 3 and r1["stopped"]
    again = ListSink()
    r2 = run(job, sink=again, stop=StopAfterLosses(again, 0), checkpoint_dir=tmp_path)
    assert r2["steps"] == 3 and r2["stopped"] and again.metrics == []
    assert (r2["final_loss"], r2["val_loss"]) == (r1["final_loss"], r1["val_loss"])
