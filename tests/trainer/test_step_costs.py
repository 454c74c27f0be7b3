"""The fusion plan's step costs measured once per host (trainer/selection/step_costs.py,
workers/step_costs.py): a later group of the same architecture plans from the kept line without
measuring; a line is never reused for another architecture, stack size or thread count; a forged
or garbled line changes at most whether a batch fuses, never what a trial computes."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from core.settings import Settings
from jobrules.spec import JobSpec
from jobrules.step_costs import MAX_BYTES, dump
from trainer.config import load_job
from trainer.protocol import ListSink, NeverStop
from trainer.selection import job as selection_job
from trainer.selection.fusion_plan import StepCost
from trainer.selection.job import run_selection
from trainer.selection.step_costs import Book, key
from workers import step_costs as host_costs

TOL = {"atol": 1e-5, "rtol": 1e-5}
CPU2 = [torch.device("cpu"), torch.device("cpu")]
BASE: dict[str, Any] = {
    "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 2, "seq_len": 8},
    "data": {"max_chars": 20_000},
    "train": {"steps": 6, "batch_size": 4, "eval_every": 2, "eval_batches": 1},
}
ASHA = {"kind": "asha", "reduction_factor": 2, "min_steps": 2}


def spec(**model: Any) -> dict[str, Any]:
    return {**BASE, "model": {**BASE["model"], **model}}


def asha_batch(base: dict[str, Any], lrs: list[float], *, first: int = 0, **kw: Any) -> dict[str, Any]:
    trials = [
        {"index": first + i, "spec": {**base, "train": {**base["train"], "lr": lr, "seed": i}}}
        for i, lr in enumerate(lrs)
    ]
    b = {"trials": trials, "metric": "val_loss", "checkpoints": "none", "early_stopping": ASHA}
    return copy.deepcopy({**b, **kw})


def run(b: dict[str, Any], costs: Path | None) -> tuple[dict[str, Any], dict[int, ListSink]]:
    """The batch over two CPU devices, as a worker group runs it, with the host's lines in `costs`."""
    sinks: dict[int, ListSink] = {}
    out = run_selection(
        b,
        sink_for_trial=lambda i: sinks.setdefault(i, ListSink()),
        stop=NeverStop(),
        devices=CPU2,
        checkpoint_root=None,
        step_costs=costs,
    )
    return out, sinks


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many stack sizes the plan measured (each call of measure_fit: one architecture)."""
    calls: list[int] = []
    real = selection_job.measure_fit

    def counting(jobs: list[JobSpec], **kw: Any) -> tuple[StepCost, int]:
        calls.append(len(jobs))
        return real(jobs, **kw)

    monkeypatch.setattr(selection_job, "measure_fit", counting)
    return calls


def group(settings: Settings, tmp: Path, name: str, b: dict[str, Any]) -> dict[str, Any]:
    """One group on a worker host: the host's lines handed over, the batch run, its measured lines
    taken back (workers/selection.py's Group does the same around its trainer)."""
    path = tmp / f"{name}.step-costs.json"
    host_costs.hand_over(settings, path, owner=1, own_code=False)
    out, _ = run(b, path)
    host_costs.learn(settings, out, owner=1, own_code=False)
    return out


def test_a_later_group_and_batch_of_the_architecture_do_not_measure_again(
    tmp_path: Path, measured: list[int]
) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    first = group(settings, tmp_path, "group-0", asha_batch(BASE, [1e-3, 3e-3, 6e-3, 1e-2]))
    assert measured and len(first["fusion"]["measured"]) == len(measured)
    assert first["fusion"]["reused"] == 0
    kept = json.loads(host_costs.host_file(settings).read_text())["costs"]
    assert sorted(kept) == sorted(m["key"] for m in first["fusion"]["measured"])

    # the batch's second group (the next indices), then another batch: nothing measured
    measured.clear()
    second = group(settings, tmp_path, "group-4", asha_batch(BASE, [2e-3, 4e-3, 5e-3, 8e-3], first=4))
    later = group(settings, tmp_path, "other", asha_batch(BASE, [1e-4, 2e-4, 3e-4, 4e-4]))
    for out in (second, later):
        assert measured == []
        assert out["fusion"]["measured"] == [] and out["fusion"]["reused"] >= 1
        assert out["fusion"]["costs"] == first["fusion"]["costs"]  # the same line, so the same plan
        assert out["fusion"]["fused"] == first["fusion"]["fused"]
        assert all(r["status"] in ("succeeded", "stopped_early") for r in out["trials"])


def test_a_line_is_never_reused_for_another_architecture(tmp_path: Path, measured: list[int]) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    group(settings, tmp_path, "narrow", asha_batch(BASE, [1e-3, 3e-3]))
    measured.clear()
    wider = group(settings, tmp_path, "wide", asha_batch(spec(d_model=32), [1e-3, 3e-3]))
    assert measured == [2] and wider["fusion"]["reused"] == 0
    bigger_batch = {**BASE, "train": {**BASE["train"], "batch_size": 8}}
    measured.clear()
    group(settings, tmp_path, "batch8", asha_batch(bigger_batch, [1e-3, 3e-3]))
    assert measured == [2]


def test_the_key_holds_what_the_step_costs_and_nothing_else() -> None:
    a = load_job(BASE)
    same = load_job({**BASE, "train": {**BASE["train"], "lr": 0.3, "seed": 7, "steps": 99}})
    assert key(a, size=2, devices=CPU2) == key(same, size=2, devices=CPU2)
    others = [
        key(load_job(spec(d_model=32)), size=2, devices=CPU2),
        key(load_job(spec(layers=2)), size=2, devices=CPU2),
        key(load_job({**BASE, "train": {**BASE["train"], "batch_size": 8}}), size=2, devices=CPU2),
        key(load_job({**BASE, "train": {**BASE["train"], "optimizer": "sgd"}}), size=2, devices=CPU2),
        key(a, size=4, devices=CPU2),
        key(a, size=2, devices=CPU2[:1]),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        others.append(key(a, size=2, devices=CPU2))
    finally:
        torch.set_num_threads(threads)
    assert len({key(a, size=2, devices=CPU2), *others}) == len(others) + 1


def test_a_line_fitted_at_two_serves_a_larger_stack_only_where_it_shares_nothing() -> None:
    jobs = [load_job({**BASE, "train": {**BASE["train"], "lr": 1e-3 * (i + 1)}}) for i in range(4)]
    at = {"at": 1e9}  # Book does not check stamps: the worker handed over current lines

    def book(size: int, fixed: float) -> Book:
        return Book({key(jobs[0], size=size, devices=CPU2): {"fixed_s": fixed, "member_s": 0.01, **at}})

    # measure stops at two members when a stack shares under MIN_GAIN, so that line is the answer
    assert book(2, 0.0).get(jobs, CPU2) == StepCost(fixed_s=0.0, member_s=0.01)
    # a stack that shares more is measured at its own size: the line at two does not stand for it
    assert book(2, 0.5).get(jobs, CPU2) is None
    assert book(4, 0.5).get(jobs, CPU2) == StepCost(fixed_s=0.5, member_s=0.01)
    assert book(4, 0.5).get(jobs[:3], CPU2) is None
    assert book(2, 0.5).get(jobs[:2], CPU2) is not None


def test_a_forged_line_changes_at_most_whether_the_batch_fuses(tmp_path: Path, measured: list[int]) -> None:
    """The group's folder is writable by the sandboxed trainer and an owner's lines come from
    trainers that ran users' code: a forged line that says a stack shares nearly all of its step
    fuses the batch, one that says it shares nothing leaves every trial alone; either way every
    trial's curve, status and steps are what they are with `fuse` off."""
    b = asha_batch(BASE, [1e-3, 3e-3, 6e-3, 1e-2])
    off, off_sinks = run({**copy.deepcopy(b), "fuse": False}, None)
    job = load_job(b["trials"][0]["spec"])
    for fixed, fuses in ((1.0, True), (0.0, False)):
        forged = tmp_path / f"forged-{fixed}.json"
        line = {"fixed_s": fixed, "member_s": 1e-6, "at": time.time()}
        forged.write_text(dump({key(job, size=4, devices=CPU2): line, key(job, size=2, devices=CPU2): line}))
        on, on_sinks = run(copy.deepcopy(b), forged)
        assert measured == [] and on["fusion"]["fused"] is fuses
        assert any(r.get("fused_with") for r in on["trials"]) is fuses
        for ra, rb in zip(off["trials"], on["trials"], strict=True):
            assert (ra["trial"], ra["status"], ra["steps"]) == (rb["trial"], rb["status"], rb["steps"])
            for name in ("loss", "val_loss"):
                a = [(s, v) for s, n, v in off_sinks[ra["trial"]].metrics if n == name]
                c = [(s, v) for s, n, v in on_sinks[ra["trial"]].metrics if n == name]
                assert [s for s, _ in a] == [s for s, _ in c]
                torch.testing.assert_close([v for _, v in c], [v for _, v in a], **TOL)
        assert on["best_trial"] == off["best_trial"]


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"\xff\xfe\x00garbage",
        b"[1, 2, 3]",
        b'{"version": 1, "costs": []}',
        b'{"version": 99, "costs": {}}',
        b"[" * 100_000,
        b" " * (MAX_BYTES + 1),
        json.dumps({"version": 1, "costs": {"0" * 64: {"fixed_s": "NaN", "member_s": -1}}}).encode(),
        json.dumps(
            {"version": 1, "costs": {"0" * 64: {"fixed_s": 1e308, "member_s": 1e308, "at": 0}}}
        ).encode(),
        "forged far ahead",  # a valid line for this very batch, stamped past what the clock allows
        "forged long ago",
    ],
)
def test_a_garbled_file_is_measured_around(tmp_path: Path, measured: list[int], content: bytes | str) -> None:
    path = tmp_path / "garbled.json"
    b = asha_batch(BASE, [1e-3, 3e-3])
    if isinstance(content, str):
        at = time.time() + (1e6 if "ahead" in content else -1e6)
        line = {"fixed_s": 1.0, "member_s": 0.01, "at": at}
        content = dump({key(load_job(b["trials"][0]["spec"]), size=2, devices=CPU2): line}).encode()
    path.write_bytes(content)
    out, _ = run(b, path)
    assert measured == [2] and out["fusion"]["reused"] == 0
    assert all(r["status"] in ("succeeded", "stopped_early") for r in out["trials"])
