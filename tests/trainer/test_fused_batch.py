"""A selection batch with `fuse` on, the default (trainer/selection/fused_batch.py): every trial
reports the losses, validation losses, steps, events, checkpoints and result it reports with `fuse`
off (the executor), to 1e-5; a trial the plan leaves alone trains as a stack of one; a trial stopped
mid-run, stopped by an ASHA rung or whose loss turns NaN leaves the stack and the others go on as
they would have. The plan's measurement is replaced here by a cost model in which fusing pays
(tests/trainer/test_fusion_plan.py tests the plan itself), so what fuses does not depend on the
machine's load."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.checkpoint import latest_checkpoint, load_checkpoint
from trainer.protocol import ListSink, NeverStop
from trainer.selection import job as selection_job
from trainer.selection.fusion_plan import StepCost
from trainer.selection.job import parse_batch, run_selection

TOL = {"atol": 1e-5, "rtol": 1e-5}
BASE: dict[str, Any] = {
    "model": {"kind": "gpt", "layers": 2, "d_model": 16, "heads": 2, "seq_len": 8},
    "data": {"max_chars": 20_000},
    "train": {"steps": 6, "batch_size": 4, "eval_every": 2, "eval_batches": 1},
    "checkpoint_every": 2,
}
FUSABLE = [
    {"lr": 3e-3, "seed": 0, "weight_decay": 0.1},
    {"lr": 1e-3, "seed": 1, "grad_clip": 0.5},
    {"lr": 6e-3, "seed": 2, "steps": 4, "eval_every": 3},  # its own length and cadence
]
WIDER = {**BASE, "model": {**BASE["model"], "d_model": 32}, "train": {**BASE["train"], "lr": 2e-3}}


@pytest.fixture(autouse=True)
def fusion_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of a stack costs about what one member's does: fusing always shortens the batch."""
    monkeypatch.setattr(
        selection_job,
        "_measure",
        lambda archs, devices, book: [StepCost(fixed_s=1.0, member_s=0.01) for _ in archs],
    )


def batch(**kw: Any) -> dict[str, Any]:
    trials = [{"index": i, "spec": {**BASE, "train": {**BASE["train"], **t}}} for i, t in enumerate(FUSABLE)]
    trials.append({"index": 3, "spec": WIDER})
    return {"trials": copy.deepcopy(trials), "metric": "val_loss", "checkpoints": "all", **kw}


def run(
    tmp: Path, b: dict[str, Any], *, stop_trials: Any = None
) -> tuple[dict[str, Any], dict[int, ListSink]]:
    sinks: dict[int, ListSink] = {}
    out = run_selection(
        b,
        sink_for_trial=lambda i: sinks.setdefault(i, ListSink()),
        stop=NeverStop(),
        devices=[torch.device("cpu")],
        checkpoint_root=tmp,
        stop_trials=stop_trials,
    )
    return out, sinks


def points(sink: ListSink, name: str) -> tuple[list[int], list[float]]:
    got = [(s, v) for s, n, v in sink.metrics if n == name]
    return [s for s, _ in got], [v for _, v in got]


def test_fused_batch_matches_the_unfused_one(tmp_path: Path) -> None:
    off, off_sinks = run(tmp_path / "off", batch(fuse=False))
    on, on_sinks = run(tmp_path / "on", batch())

    # the three fusable trials were fused; the wider one trained alone, a stack of one
    for i in range(3):
        assert any("fused with trials 0, 1, 2" in line for line in on_sinks[i].logs), on_sinks[i].logs
    assert any("trial 3 trains alone" in x for x in on_sinks[3].logs), on_sinks[3].logs
    assert not any("fused with" in x for s in off_sinks.values() for x in s.logs)
    assert [r.get("fused_with") for r in on["trials"]] == [[1, 2], [0, 2], [0, 1], None]
    assert on["fusion"]["fused"] and off["fusion"] is None

    for i in range(4):
        a, b = off_sinks[i], on_sinks[i]
        # the same metric names on the same steps
        assert sorted({(s, n) for s, n, _ in a.metrics}) == sorted({(s, n) for s, n, _ in b.metrics})
        for name in ("loss", "val_loss"):
            steps_a, values_a = points(a, name)
            steps_b, values_b = points(b, name)
            assert steps_a == steps_b and values_a, (i, name)
            torch.testing.assert_close(values_b, values_a, **TOL)
        # the same events: running, the checkpoints (every 2 steps and the last), the end
        assert [(e, d["status"]) for e, d in b.events if e == "trial"] == [
            (e, d["status"]) for e, d in a.events if e == "trial"
        ]
        assert [d["step"] for e, d in b.events if e == "checkpoint"] == [
            d["step"] for e, d in a.events if e == "checkpoint"
        ]
    assert points(on_sinks[2], "val_loss")[0] == [3, 4]  # trial 2: its own eval_every and steps

    # the results have the executor's shape and numbers; the leaderboard is the same
    for ra, rb in zip(off["trials"], on["trials"], strict=True):
        assert ra.keys() | {"fused_with"} == rb.keys()
        assert (ra["trial"], ra["status"], ra["steps"]) == (rb["trial"], rb["status"], rb["steps"])
        for key in ("final_loss", "val_loss", "best_metric", "last_metric"):
            torch.testing.assert_close(rb[key], ra[key], **TOL)
    assert [r["trial"] for r in on["leaderboard"]] == [r["trial"] for r in off["leaderboard"]]
    assert on["best_trial"] == off["best_trial"]

    # a fused trial's checkpoint is the executor's, in its format: the same weights and state
    for i in range(4):
        ca = load_checkpoint(latest_checkpoint(tmp_path / "off" / f"trial-{i}"))
        cb = load_checkpoint(latest_checkpoint(tmp_path / "on" / f"trial-{i}"))
        assert ca["step"] == cb["step"]
        torch.testing.assert_close(cb["model"], ca["model"], **TOL)
        torch.testing.assert_close(cb["optimizer"], ca["optimizer"], atol=1e-5, rtol=1e-4)


def test_a_fused_batch_resumes_and_keeps_the_best_checkpoint_only(tmp_path: Path) -> None:
    """Run again, the finished trials resume from their checkpoints (through the executor, so
    nothing retrains); checkpoints `best` keeps only the batch's best trial's directory."""
    out, _ = run(tmp_path, batch(checkpoints="best"))
    assert [p.name for p in tmp_path.iterdir()] == [f"trial-{out['best_trial']}"]
    again, sinks = run(tmp_path, batch(checkpoints="all"))
    best = out["best_trial"]
    assert any(f"trial {best} not fused: it resumes from its checkpoint" in x for x in sinks[best].logs)
    assert not sinks[best].series("loss")  # nothing retrained


def test_a_trial_stopped_mid_run_leaves_only_its_member(tmp_path: Path) -> None:
    off, off_sinks = run(tmp_path / "off", batch(fuse=False))
    sinks: dict[int, ListSink] = {}

    def stop_trials() -> set[int]:  # trial 1 stops once it has reported its second step
        return {1} if 1 in sinks and len(sinks[1].series("loss")) >= 2 else set()

    on = run_selection(
        batch(),
        sink_for_trial=lambda i: sinks.setdefault(i, ListSink()),
        stop=NeverStop(),
        devices=[torch.device("cpu")],
        checkpoint_root=tmp_path / "on",
        stop_trials=stop_trials,
    )
    status = {r["trial"]: (r["status"], r["steps"]) for r in on["trials"]}
    assert status == {0: ("succeeded", 6), 1: ("stopped", 2), 2: ("succeeded", 4), 3: ("succeeded", 6)}
    assert [d for e, d in sinks[1].events if e == "trial"][-1] == {"status": "stopped", "steps_done": 2}
    assert load_checkpoint(latest_checkpoint(tmp_path / "on" / "trial-1"))["step"] == 2
    torch.testing.assert_close(sinks[1].series("loss"), off_sinks[1].series("loss")[:2], **TOL)
    for i in (0, 2, 3):  # the others went on exactly as they would have
        torch.testing.assert_close(sinks[i].series("loss"), off_sinks[i].series("loss"), **TOL)
        torch.testing.assert_close(sinks[i].series("val_loss"), off_sinks[i].series("val_loss"), **TOL)


def test_the_batch_stop_ends_every_member() -> None:
    class After:
        def __init__(self) -> None:
            self.sink = ListSink()

        def requested(self) -> bool:
            return len(self.sink.series("loss")) >= 3

    stop = After()
    sinks = {0: stop.sink}
    out = run_selection(
        batch(checkpoints="none"),
        sink_for_trial=lambda i: sinks.setdefault(i, ListSink()),
        stop=stop,
        devices=[torch.device("cpu")],
        checkpoint_root=None,
    )
    status = {r["trial"]: (r["status"], r["steps"]) for r in out["trials"]}
    assert {i: s for i, s in status.items() if i < 3} == dict.fromkeys(range(3), ("stopped", 3))
    assert status[3] == ("stopped", 0)  # the stack of one after them had not started


def test_fuse_is_on_unless_asked_off() -> None:
    assert parse_batch(batch()).fuse and not parse_batch(batch(fuse=False)).fuse
    es = {"kind": "asha", "reduction_factor": 2, "min_steps": 2}
    assert parse_batch(batch(early_stopping=es)).fuse


def run_two(tmp: Path, b: dict[str, Any]) -> tuple[dict[str, Any], dict[int, ListSink]]:
    """The batch over two CPU devices, the way a worker group runs it."""
    sinks: dict[int, ListSink] = {}
    out = run_selection(
        b,
        sink_for_trial=lambda i: sinks.setdefault(i, ListSink()),
        stop=NeverStop(),
        devices=[torch.device("cpu"), torch.device("cpu")],
        checkpoint_root=tmp,
    )
    return out, sinks


def same_curves(a: ListSink, b: ListSink) -> None:
    for name in ("loss", "val_loss"):
        assert points(a, name)[0] == points(b, name)[0], name
        torch.testing.assert_close(points(b, name)[1], points(a, name)[1], **TOL)


@pytest.mark.parametrize("kind", ["asha", "sha", "hyperband"])
def test_rungs_stop_members_as_the_executor_does_and_the_others_go_on(tmp_path: Path, kind: str) -> None:
    """Early stopping over fused stacks on two devices: members that wait at a rung (SHA: every
    one, until the rung is full) leave their stack and come back when promoted; the decisions,
    stop reasons and every curve are the executor's."""
    train = {**BASE["train"], "steps": 8, "eval_every": 2}
    trials = [
        {"index": i, "spec": {**BASE, "train": {**train, "lr": lr, "seed": i}}}
        for i, lr in enumerate([3e-3, 1e-3, 6e-3, 3e-4, 2e-3, 5e-3])
    ]
    es = {"kind": kind, "reduction_factor": 2, "min_steps": 2}
    b = {"trials": trials, "metric": "val_loss", "checkpoints": "none", "early_stopping": es}
    off, off_sinks = run_two(tmp_path / "off", {**copy.deepcopy(b), "fuse": False})
    on, on_sinks = run_two(tmp_path / "on", copy.deepcopy(b))
    assert on["fusion"]["fused"]
    assert any(r["fused_with"] for r in on["trials"])
    stopped = [r["trial"] for r in off["trials"] if r["status"] == "stopped_early"]
    assert stopped  # the rungs cut some trials short
    for ra, rb in zip(off["trials"], on["trials"], strict=True):
        assert (ra["trial"], ra["status"], ra["steps"]) == (rb["trial"], rb["status"], rb["steps"])
        assert ra["stop_reason"] is None or rb["stop_reason"]["rung"] == ra["stop_reason"]["rung"]
        same_curves(off_sinks[ra["trial"]], on_sinks[ra["trial"]])
    assert on["best_trial"] == off["best_trial"]


def test_a_member_whose_loss_turns_nan_fails_alone(tmp_path: Path) -> None:
    """SGD with lr 10 and momentum 0.9 reaches a NaN loss at step 7 on this model: that member
    fails there, as it does alone, and its stack's others train on, unchanged."""
    train = {**BASE["train"], "steps": 9, "optimizer": "sgd", "momentum": 0.9, "eval_every": 3}
    trials = [
        {"index": i, "spec": {**BASE, "train": {**train, "lr": lr, "seed": i}}}
        for i, lr in enumerate([0.1, 10.0, 0.3])
    ]
    b = {"trials": trials, "metric": "val_loss", "checkpoints": "none"}
    off, off_sinks = run(tmp_path / "off", {**copy.deepcopy(b), "fuse": False})
    on, on_sinks = run(tmp_path / "on", copy.deepcopy(b))
    assert on["trials"][0]["fused_with"] == [1, 2]
    for ra, rb in zip(off["trials"], on["trials"], strict=True):
        assert (ra["status"], ra["steps"], ra["error"]) == (rb["status"], rb["steps"], rb["error"])
    assert on["trials"][1]["status"] == "failed" and "loss is nan at step 7" in on["trials"][1]["error"]
    for i in (0, 2):
        same_curves(off_sinks[i], on_sinks[i])


def test_nothing_fuses_where_the_plan_says_it_would_not_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack of k costs k singles (one CPU thread, a compute-bound model): every trial goes
    through the executor, as with fuse off, and each log says why with the plan's numbers."""
    monkeypatch.setattr(
        selection_job,
        "_measure",
        lambda archs, devices, book: [StepCost(fixed_s=0.0, member_s=0.01) for _ in archs],
    )
    sinks: dict[int, ListSink] = {}
    out = run_selection(
        batch(checkpoints="none"),
        sink_for_trial=lambda i: sinks.setdefault(i, ListSink()),
        stop=NeverStop(),
        devices=[torch.device("cpu")],
        checkpoint_root=None,
    )
    assert out["fusion"]["fused"] is False
    assert out["fusion"]["makespan_s"] == pytest.approx(out["fusion"]["unfused_s"])
    assert all(r.get("fused_with") is None and r["status"] == "succeeded" for r in out["trials"])
    for i in range(3):
        assert any(f"trial {i} not fused: fusion plan:" in x and "no fusion" in x for x in sinks[i].logs)
    assert any("trial 3 not fused: model.d_model differs (16 vs 32)" in x for x in sinks[3].logs)
