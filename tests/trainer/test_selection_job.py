"""The batch entry: run_selection with per-trial sinks, and the CLI the worker launches."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from jobrules.spec import SpecError
from trainer.protocol import ListSink, NeverStop
from trainer.selection.job import parse_batch, run_selection
from trainer.selection.space import expand
from workers.selection import selection_command

BASE = {
    "model": {"kind": "mlp", "layers": 2, "d_model": 16, "seq_len": 8},
    "data": {"max_chars": 200_000},
    "train": {"steps": 4, "batch_size": 4, "eval_every": 2, "eval_batches": 1, "optimizer": "sgd"},
    "parallel": {"spill": {"device_budget_mb": 64, "cuts": [2]}},
}


def batch(seeds: tuple[int, ...] = (0, 1), **kw: object) -> dict:
    space = {"train.lr": [0.3, 0.03, 0.003], "train.seed": list(seeds)}
    plans = expand(base=BASE, space=space, method="grid")
    return {
        "trials": [{"index": p.index, "spec": p.spec} for p in plans],
        "metric": "val_loss",
        "mode": "min",
        "scheduler": "shard-lrtf",
        "early_stopping": None,
        **kw,
    }


def test_run_selection_reports_per_trial_and_ranks_the_leaderboard(tmp_path: Path) -> None:
    b = batch(early_stopping={"kind": "asha", "reduction_factor": 3, "min_steps": 2})
    b["trials"].append({"index": 9, "spec": {**BASE, "train": {"steps": 0}}})  # a bad spec fails alone
    sinks: dict[int, ListSink] = {}
    out = run_selection(
        b,
        sink_for_trial=lambda i: sinks.setdefault(i, ListSink()),
        stop=NeverStop(),
        devices=[torch.device("cpu")] * 2,
        checkpoint_root=tmp_path,
    )
    status = {r["trial"]: r["status"] for r in out["trials"]}
    assert status[9] == "failed" and "train.steps" in out["trials"][-1]["error"]
    assert set(status) == set(range(6)) | {9}
    assert sorted(status.values()).count("stopped_early") >= 3  # 6 trials, one rung at step 2, keep 2
    board = out["leaderboard"]
    assert [r["best_metric"] for r in board] == sorted(r["best_metric"] for r in board)
    assert out["best_trial"] == board[0]["trial"] and status[board[0]["trial"]] == "succeeded"
    for i in range(6):
        events = [d for e, d in sinks[i].events if e == "trial"]
        assert events[0] == {"status": "running", "steps_done": 0}
        assert events[-1]["status"] == status[i] and events[-1]["steps_done"] == len(sinks[i].series("loss"))
        assert sinks[i].series("val_loss")  # every trial evaluated at least at the rung
    # checkpoints "best" (the default): only the best trial's directory stays
    assert [p.name for p in tmp_path.iterdir()] == [f"trial-{out['best_trial']}"]
    # the best metric of each trial is the min of what its sink received
    for r in out["trials"][:6]:
        assert r["best_metric"] == min(sinks[r["trial"]].series("val_loss"))


def test_finished_trials_resume_from_their_checkpoints(tmp_path: Path) -> None:
    kw = {"stop": NeverStop(), "devices": [torch.device("cpu")], "checkpoint_root": tmp_path}
    b = batch(seeds=(0,), scheduler="fifo", checkpoints="all")
    run_selection(b, sink_for_trial=lambda i: ListSink(), **kw)
    sinks: dict[int, ListSink] = {}
    out = run_selection(b, sink_for_trial=lambda i: sinks.setdefault(i, ListSink()), **kw)
    assert all(r["status"] == "succeeded" and r["steps"] == 4 for r in out["trials"])
    assert all(not s.series("loss") for s in sinks.values())  # nothing retrained


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # the words of the API's 422 for the same fields (one model, jobrules/spec.py)
        ({"scheduler": "lifo"}, "scheduler: Input should be 'shard-lrtf', 'fifo'"),
        ({"trials": []}, "trials: List should have at least 1 item"),
        (
            {"metric": "9lives"},
            "metric: metric must be val_loss or loss or a user metric's name: metric name '9lives' must match",
        ),
        ({"early_stopping": {"kind": "median"}}, "early_stopping.kind: Input should be 'asha', 'sha' or"),
        ({"checkpoints": "latest"}, "checkpoints: Input should be 'best', 'all' or 'none'"),
        ({"seed": "zero"}, "seed: Input should be a valid integer"),
        ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
        (
            {"early_stopping": {"kind": "asha", "reduction_factor": 1}},
            "early_stopping.reduction_factor: Input should be greater than or equal to 2",
        ),
        ({"colour": 1}, "colour: Extra inputs are not permitted"),
    ],
)
def test_bad_batches_name_the_problem(change: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_batch(batch(**change))


def test_duplicate_trial_indices_are_refused() -> None:
    b = batch()
    b["trials"][1]["index"] = 0
    with pytest.raises(SpecError, match=r"body: trials indices must be unique, got \[0, 0"):
        parse_batch(b)


def cli(tmp_path: Path, b: dict, *extra: str) -> tuple[int, list[dict]]:
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(b))
    proc = subprocess.run(
        selection_command(path, 2, "--device", "cpu", *extra),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.stderr == "" or proc.returncode != 0, proc.stderr
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]


def test_cli_tags_every_line_with_its_trial_and_stops_listed_trials(tmp_path: Path) -> None:
    stop_trials = tmp_path / "stop.json"
    stop_trials.write_text("[4, 5]")
    rc, lines = cli(
        tmp_path, batch(), "--stop-trials-file", str(stop_trials), "--checkpoint-root", str(tmp_path)
    )
    assert rc == 0
    assert all("trial" in line for line in lines)
    final = lines[-1]
    assert final["kind"] == "batch_result" and final["trial"] is None
    assert all(line["trial"] in range(6) for line in lines[:-1])
    status = {r["trial"]: r["status"] for r in final["data"]["trials"]}
    assert status == {
        0: "succeeded",
        1: "succeeded",
        2: "succeeded",
        3: "succeeded",
        4: "stopped",
        5: "stopped",
    }
    for i in range(4):
        losses = [x for x in lines if x["trial"] == i and x["kind"] == "metric" and x["name"] == "loss"]
        assert [x["step"] for x in losses] == [1, 2, 3, 4]
    assert not [x for x in lines if x["trial"] in (4, 5) and x["kind"] == "metric"]


def test_cli_stop_file_and_bad_batch(tmp_path: Path) -> None:
    stop = tmp_path / "STOP"
    stop.touch()
    rc, lines = cli(tmp_path, batch(seeds=(0,)), "--stop-file", str(stop))
    assert rc == 0
    assert {r["status"] for r in lines[-1]["data"]["trials"]} == {"stopped"}
    rc, lines = cli(tmp_path, batch(scheduler="lifo"))
    assert (
        rc == 2
        and lines[-1]["kind"] == "error"
        and lines[-1]["message"].startswith("bad batch: scheduler: Input should be 'shard-lrtf'")
    )


def test_cli_device_processes_and_device_threads_print_the_same_numbers(tmp_path: Path) -> None:
    """Two CPU devices run as forked processes by default and as threads with --device-threads
    (and as processes with one task an order, --chunk-tasks 1); every trial's metrics are the
    same, value for value."""

    def metrics(lines: list[dict]) -> dict:
        return {(x["trial"], x["step"], x["name"]): x["value"] for x in lines if x["kind"] == "metric"}

    runs = {}
    for extra in ((), ("--device-threads",), ("--chunk-tasks", "1")):
        rc, lines = cli(tmp_path, batch(), *extra)
        assert rc == 0 and lines[-1]["kind"] == "batch_result"
        runs[extra] = {k: v for k, v in metrics(lines).items() if k[2] in ("loss", "val_loss")}
    assert runs[()] and runs[()] == runs[("--device-threads",)] == runs[("--chunk-tasks", "1")]
    rc, lines = cli(tmp_path, batch(), "--chunk-tasks", "0")
    assert rc == 2 and lines[-1]["message"] == "bad batch: --chunk-tasks must be >= 1, got 0"


@pytest.mark.parametrize(
    "extra",
    [("--device-threads", "--chunk-tasks", "4"), ("--devices", "1", "--chunk-tasks", "4")],
    ids=["device-threads", "one-device"],
)
def test_cli_refuses_chunk_tasks_where_devices_are_threads(tmp_path: Path, extra: tuple[str, ...]) -> None:
    # chunks are for CPU device processes: asked for where the devices are threads, the batch is
    # refused with the reason, not run without them
    rc, lines = cli(tmp_path, batch(), *extra)
    assert rc == 2
    assert lines[-1]["kind"] == "error"
    assert "chunk_tasks: applies to CPU device processes only" in lines[-1]["message"]
    assert not [x for x in lines if x["kind"] == "metric"]
