"""A user's own metrics (trainer/report.py): the rules of a report (name, value, how many names),
nothing recorded outside training, and a workspace model and data source whose reports land once
per step through the one loop (an evaluation's mean at an evaluating step) and rank a selection
batch's trials through the executor."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from jobrules.spec import BatchRules, SelectionCreate
from tests.trainer.user_metrics_src import USER_METRICS
from trainer.config import load_job
from trainer.protocol import ListSink, NeverStop
from trainer.report import MetricReportError, NameLimit, Reports, collecting, emit, evaluation, report
from trainer.runner import run
from trainer.workspace import set_workspace


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("metrics-ws")
    (root / "scored.py").write_text(USER_METRICS)
    return root


def train(raw: dict[str, Any], workspace: Path) -> tuple[ListSink, dict[str, Any]]:
    set_workspace(workspace)
    try:
        sink = ListSink()
        result = run(load_job(raw), sink=sink, stop=NeverStop())
        return sink, result
    finally:
        set_workspace(None)
        sys.modules.pop("scored", None)


def job(entry: str = "scored:scored", **train: Any) -> dict[str, Any]:
    return {
        "model": {"kind": "python", "entry": entry, "args": {}},
        "data": {"kind": "python", "entry": "scored:labelled_images"},
        "train": {"steps": 6, "batch_size": 16, "lr": 1e-2, "eval_every": 3, "eval_batches": 2, **train},
        "resources": {"device": "cpu"},
    }


def test_report_rules() -> None:
    report("accuracy", float("nan"))  # outside training: nothing checked, nothing recorded
    reports = Reports()
    with collecting(reports):
        report("accuracy", 0.5)
        report("accuracy", torch.tensor(1.0))
        report("eval/bleu-4.x", 3)
        with evaluation(reports):
            report("accuracy", 0.25)
        for name in ("loss", "val_loss", "hw.cpu", "1x", "a b", "x" * 65, ""):
            with pytest.raises(MetricReportError, match="metric name"):
                report(name, 1.0)
        for value in (math.inf, float("nan")):
            with pytest.raises(MetricReportError, match="finite"):
                report("accuracy", value)
        for value in ("0.5", None, torch.ones(2), True):
            with pytest.raises(MetricReportError, match="real number|one element"):
                report("accuracy", value)
    # a thread with a collector of its own reports there, not into the process's
    mine = Reports()

    def in_thread() -> None:
        with collecting(mine, thread=True):
            report("other", 2.0)

    with collecting(reports):
        t = threading.Thread(target=in_thread)
        t.start()
        t.join()
    assert mine.take() == {"other": 2.0}
    sink = ListSink()
    names = NameLimit(limit=2)
    # the evaluation's mean wins at an evaluating step
    assert emit(sink, step=3, reports=reports, names=names) == {"accuracy": 0.25, "eval/bleu-4.x": 3.0}
    assert sink.metrics == [(3, "accuracy", 0.25), (3, "eval/bleu-4.x", 3.0)]
    with collecting(reports):
        report("third", 1.0)
    with pytest.raises(MetricReportError, match="at most 2 distinct metric names"):
        emit(sink, step=4, reports=reports, names=names)


def test_reports_land_once_per_step_through_the_loop(workspace: Path) -> None:
    sink, result = train(job(), workspace)
    steps = [s for s, n, _ in sink.metrics if n == "loss"]
    assert steps == [1, 2, 3, 4, 5, 6]
    for name in ("accuracy", "data/class0"):
        assert [s for s, n, _ in sink.metrics if n == name] == steps, name
    # validation batches report under their own name, at the evaluating steps
    assert [s for s, n, _ in sink.metrics if n == "val_accuracy"] == [3, 6]
    assert all(0.0 <= v <= 1.0 for v in sink.series("accuracy") + sink.series("val_accuracy"))
    assert result["steps"] == 6


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("scored:bad_name", "metric name 'val_loss' is the trainer's own"),
        ("scored:not_finite", "report('ratio', nan): the value must be a finite number"),
        ("scored:too_many", "at most 64 distinct metric names"),
    ],
)
def test_a_broken_report_fails_the_run_with_the_reason(workspace: Path, entry: str, reason: str) -> None:
    with pytest.raises(Exception, match=reason.replace("(", r"\(").replace(")", r"\)")):
        train(job(entry, steps=2), workspace)


def test_a_selection_may_rank_by_a_user_metric() -> None:
    assert BatchRules(metric="eval/bleu", mode="max").metric == "eval/bleu"
    base = job()
    for bad, why in [("hw.gpu", "hardware samples"), ("tokens_per_s", "trainer's own"), ("9", "must match")]:
        with pytest.raises(ValueError, match=why):
            SelectionCreate(base=base, space={"train.lr": [0.1]}, metric=bad)
    with pytest.raises(ValueError, match="only a workspace's own code reports"):
        SelectionCreate(
            base={**base, "model": {"kind": "gpt"}, "data": {}}, space={"train.lr": [0.1]}, metric="accuracy"
        )


@pytest.mark.parametrize("processes", [False, True])
def test_the_executor_records_and_ranks_by_a_user_metric(workspace: Path, processes: bool) -> None:
    """Device threads or forked device processes: each trial's reports land once per step, its best
    is the best of its own series by the batch's mode, and a trial that never reports the batch's
    metric fails saying so."""
    from trainer.selection.executor import Executor, ExecutorConfig, TrialEntry

    specs = [job(steps=4, lr=lr) for lr in (3e-2, 1e-3)] + [job("scored:make", steps=4)]
    set_workspace(workspace)
    try:
        sinks = [ListSink() for _ in specs]
        entries = [TrialEntry(index=i, job=load_job(s), sink=sinks[i]) for i, s in enumerate(specs)]
        cfg = ExecutorConfig(metric="accuracy", mode="max", device_processes=processes)
        results = Executor(entries, devices=[torch.device("cpu")] * 2, cfg=cfg).run()
    finally:
        set_workspace(None)
        sys.modules.pop("scored", None)
    for i in (0, 1):
        assert results[i]["status"] == "succeeded", results[i]
        assert [s for s, n, _ in sinks[i].metrics if n == "accuracy"] == [1, 2, 3, 4]
        assert [s for s, n, _ in sinks[i].metrics if n == "val_accuracy"] == [3, 4]
        assert results[i]["best_metric"] == max(sinks[i].series("accuracy"))
    assert results[2]["status"] == "failed"
    assert "MetricNotReported" in results[2]["error"] and "'accuracy'" in results[2]["error"]


def test_halving_rungs_rank_by_a_user_metric(workspace: Path) -> None:
    """Successive halving's rungs take each trial's accuracy (its evaluation runs at the rung too):
    the trial that reports none ranks last there and is stopped early; the most accurate goes on
    to the end."""
    from trainer.selection.executor import Executor, ExecutorConfig, TrialEntry
    from trainer.selection.halving import HalvingConfig

    specs = [job(steps=6, eval_every=6, lr=lr) for lr in (3e-2, 1e-4)] + [
        job("scored:make", steps=6, eval_every=6)
    ]
    set_workspace(workspace)
    try:
        sinks = [ListSink() for _ in specs]
        entries = [TrialEntry(index=i, job=load_job(s), sink=sinks[i]) for i, s in enumerate(specs)]
        rungs = HalvingConfig(kind="sha", reduction_factor=3, min_steps=2, mode="max")
        cfg = ExecutorConfig(metric="accuracy", mode="max", early_stopping=rungs, device_processes=False)
        results = Executor(entries, devices=[torch.device("cpu")], cfg=cfg).run()
    finally:
        set_workspace(None)
        sys.modules.pop("scored", None)
    assert results[2]["status"] == "stopped_early", results
    finished = [i for i in (0, 1) if results[i]["status"] == "succeeded"]
    assert len(finished) == 1 and results[finished[0]]["steps"] == 6
    # the rung's evaluation reported val_accuracy at step 2, though eval_every is 6
    assert [s for s, n, _ in sinks[finished[0]].metrics if n == "val_accuracy"] == [2, 6]
