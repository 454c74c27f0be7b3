"""bench/fused_gpu.py's parts that need no GPU: its arguments, its refusal without CUDA (exit 2,
nothing run, nothing written), the order of its sides and the summary of two runs (the ratio, the
best trial, the stacks, the loss curves compared). The benchmark itself needs a lent CUDA device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import bench.fused_gpu as fg

PARAMS = {i: {"train.lr": [1e-3, 3e-3][i % 2], "model.layers": 2} for i in range(4)}


def test_defaults_and_flags() -> None:
    a = fg.parse_args([])
    assert (a.reps, a.steps, a.warmup_steps, a.device, a.out) == (2, 60, 2, "cuda", "fused_gpu")
    a = fg.parse_args(["--device", "cpu", "--steps", "4", "--reps", "1", "--warmup-steps", "0"])
    assert (a.reps, a.steps, a.warmup_steps, a.device) == (1, 4, 0, "cpu")


@pytest.mark.parametrize(
    "argv", [["--reps", "0"], ["--steps", "0"], ["--warmup-steps", "-1"], ["--device", "cuda:1"]]
)
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        fg.parse_args(argv)
    assert e.value.code == 2


def _no_run(*a: Any, **k: Any) -> Any:
    raise AssertionError("nothing may run")


def test_without_cuda_it_exits_2_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fg, "run_executor", _no_run)
    monkeypatch.setattr(fg, "write_results", _no_run)
    assert fg.main(["--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err and "--device cpu" in err
    assert fg.device_problem("cpu") is None


def _run(side: str, rep: int, wall: float, best: int, curves: dict, fused_with: dict | None = None) -> dict:
    fused_with = fused_with or {}
    per = {
        i: {"val_loss": 1.0 if i == best else 2.0 + i, "steps": 3, "fused_with": fused_with.get(i)}
        for i in PARAMS
    }
    return {
        "side": side,
        "rep": rep,
        "wall_s": wall,
        "trials": per,
        "curves": curves,
        "best": fg.best_of(per, PARAMS),
    }


def _curves(shift: float = 0.0) -> dict[int, dict[int, float]]:
    return {
        i: {s: 3.0 - 0.1 * s + i + (shift if i == 2 and s == 1 else 0.0) for s in range(3)} for i in PARAMS
    }


STACKS = {0: [2], 2: [0], 1: [3], 3: [1]}


def test_the_summary_of_two_runs() -> None:
    runs = [
        _run("fused", 0, 10.0, 1, _curves(), STACKS),
        _run("unfused", 0, 25.0, 1, _curves(4e-6)),
    ]
    s = fg.summarize(runs)
    assert s["medians"] == {"fused": 10.0, "unfused": 25.0}
    assert s["unfused_over_fused"] == pytest.approx(2.5)
    assert s["same_best"] and s["bests"] == [1]
    assert s["fused_groups"] == {0: [[0, 2], [1, 3]]}
    assert not s["unfused_fused_any"]
    assert s["curve_max_diff"] == pytest.approx(4e-6)
    assert s["curve_diff_per_rep"][0]["per_trial"][0] == 0.0
    assert s["curves_within_1e-5"] is True and s["curves_same_steps"] is True
    rows = {r["side"]: r for r in s["rows"]}
    assert rows["fused"]["trials fused (per run)"] == "4"
    assert rows["unfused"]["trials fused (per run)"] == "0"
    text = fg.report(s, reps=1)
    assert "2.500" in text and "[[0, 2], [1, 3]]" in text and "True" in text


def test_a_summary_that_fails_its_checks() -> None:
    short = _curves()
    short[3].pop(2)
    runs = [
        _run("fused", 0, 10.0, 1, _curves(3e-5), STACKS),
        _run("unfused", 0, 8.0, 0, short),
    ]
    s = fg.summarize(runs)
    assert s["unfused_over_fused"] == pytest.approx(0.8)
    assert not s["same_best"] and s["bests"] == [0, 1]
    assert s["curve_max_diff"] == pytest.approx(3e-5)
    assert s["curves_within_1e-5"] is False and s["curves_same_steps"] is False


def test_no_curves_is_no_evidence() -> None:
    s = fg.summarize([_run("fused", 0, 1.0, 0, {}, STACKS), _run("unfused", 0, 1.0, 0, {})])
    assert s["curve_max_diff"] is None and s["curves_within_1e-5"] is False
    assert "nothing to compare" in fg.report(s, reps=1)


def test_sides_alternate_and_cpu_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert fg.order(0) == ("fused", "unfused") and fg.order(1) == ("unfused", "fused")
    calls: list[tuple[bool, str, int, int]] = []

    def fake(ts: list[dict], mode: str, tmp: Path, **k: Any) -> dict:
        calls.append((k["fuse"], k["device"], k["devices"], ts[0]["spec"]["train"]["steps"]))
        assert all(t["spec"]["resources"]["device"] == "cpu" for t in ts)
        per = {t["index"]: {"val_loss": 1.0 + t["index"], "steps": 3, "fused_with": None} for t in ts}
        return {"wall_s": 1.0, "trials": per, "curves": {0: {0: 1.0}}}

    monkeypatch.setattr(fg, "run_executor", fake)
    monkeypatch.setattr(fg, "write_results", _no_run)
    assert fg.main(["--device", "cpu", "--steps", "5", "--reps", "2", "--warmup-steps", "1"]) == 0
    assert calls == [
        (True, "cpu", 1, 1),
        (True, "cpu", 1, 5),
        (False, "cpu", 1, 5),
        (False, "cpu", 1, 5),
        (True, "cpu", 1, 5),
    ]
    out = capsys.readouterr().out
    assert "no results written" in out and "unfused / fused wall" in out


def test_loss_curves_read_from_the_executors_lines() -> None:
    from bench.peer import loss_curves

    lines = [
        '{"seq":0,"trial":1,"kind":"metric","step":1,"name":"loss","value":3.5,"time":0}',
        '{"seq":1,"trial":1,"kind":"metric","step":1,"name":"val_loss","value":9.0,"time":0}',
        '{"seq":2,"trial":0,"kind":"metric","step":2,"name":"loss","value":3.25,"time":0}',
        '{"seq":3,"trial":null,"kind":"batch_result","data":{"metric":"loss"},"time":0}',
        '{"seq":4,"trial":1,"kind":"log","message":"\\"metric\\"","time":0}',
    ]
    assert loss_curves("\n".join(lines)) == {1: {1: 3.5}, 0: {2: 3.25}}
