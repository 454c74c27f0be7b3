"""A spilled job with its optimizer state on the host (`parallel.spill.optimizer` "auto": every
shard's Adam moments in host memory, stepped by HostSteps' thread) killed with SIGKILL while a host
step is in flight, then started again on its checkpoint folder as a retried attempt is: it resumes
from the checkpoint written before the kill, emits every step after it once, and ends with the
numbers of an uninterrupted run bit for bit (the host step is torch's fused kernel over the same
fp32 values, and a step's batch depends on the step alone, so resuming is exact).

The kill's moment: the killed process runs the real trainer (`trainer.__main__.main`) from a
`python -c` script that first registers a global optimizer step pre-hook, as
tests/trainer/test_checkpoint.py's killed writer patches torch.save in its own child; nothing in
trainer/ knows of it. In the host-step thread, as it starts to step the first shard of training
step HOLD_AT, the hook writes a marker and blocks, so that step is running when the kill lands (the
training thread, which waits for the shard's step before its next forward, is held with it).

The trainer level: what the worker adds around a retried attempt (storing each (name, step) once,
resuming at or below the applied step) is the same for every engine, and
tests/integration/test_failure_retries.py and test_faults.py kill trainers under it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import checkpoint_path, checkpoint_steps, load_checkpoint

STEPS, EVERY, HOLD_AT = 20, 5, 8
SPEC: dict[str, Any] = {
    "model": {"kind": "gpt", "layers": 3, "d_model": 32, "heads": 4, "seq_len": 16},
    "data": {"max_chars": 100_000},
    "train": {"steps": STEPS, "batch_size": 4, "lr": 1e-2, "eval_every": 10, "eval_batches": 2},
    "resources": {"device": "cpu"},
    # 4 shards (cuts [2, 3, 4]) and no room for shard 0's state beside them: all four step on the host
    "parallel": {"spill": {"device_budget_mb": 0.4}},
    "checkpoint_every": EVERY,
}
ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    # one thread each: the processes share the machine, and equal settings keep them comparable
    "OMP_NUM_THREADS": "1",
}
ENV.pop("SHARDYARD_CHECKPOINT_KEEP", None)

_HELD_HOST_STEP = """
import sys
import threading
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainer.__main__ import exit_now, main
from trainer.protocol import protocol_channel

marker, hold_at = Path(sys.argv[1]), int(sys.argv[2])


def hold(opt, args, kwargs):  # before every optimizer step of this process
    if not threading.current_thread().name.startswith("spill-host-step"):
        return
    first = opt.param_groups[0]["params"][0]
    if int(opt.state[first]["step"]) + 1 == hold_at:  # the training step this call steps
        # written aside and renamed: the test, polling for the marker, never reads it half written
        part = marker.with_name(marker.name + ".part")
        part.write_text(threading.current_thread().name)
        part.replace(marker)
        threading.Event().wait()  # never set: the kill lands here


register_optimizer_step_pre_hook(hold)
exit_now(main(sys.argv[3:], protocol=protocol_channel()))
"""


def _trainer(spec: Path, ckpt: Path, out: Path, *, held: Path | None = None) -> subprocess.Popen[bytes]:
    args = ["--spec", str(spec), "--checkpoint-dir", str(ckpt)]
    cmd = [sys.executable, "-m", "trainer", *args]
    if held is not None:
        cmd = [sys.executable, "-c", _HELD_HOST_STEP, str(held), str(HOLD_AT), *args]
    with out.open("wb") as stdout, out.with_suffix(".err").open("wb") as stderr:
        return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=ENV)


def _lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in out.read_text().splitlines() if ln.startswith("{")]


def _err(out: Path) -> str:
    return out.with_suffix(".err").read_text()[-3000:]


def _series(lines: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """name -> [(step, value)] in the order the lines came."""
    out: dict[str, list[tuple[int, float]]] = {}
    for ln in lines:
        if ln["kind"] == "metric":
            out.setdefault(ln["name"], []).append((ln["step"], ln["value"]))
    return out


def _steps(points: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in points]


MEASURED = {"step_time_ms", "tokens_per_s", "peak_mem_mb"}
"""Per-step metrics the machine gives (times, the process's memory): their steps are compared, not
their values."""


def test_a_host_step_job_killed_mid_host_step_resumes_to_the_uninterrupted_numbers(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    ref_out, killed_out, resumed_out = tmp_path / "ref.out", tmp_path / "killed.out", tmp_path / "resumed.out"
    ref = _trainer(spec, tmp_path / "ref-ckpt", ref_out)  # runs while the other is held and killed
    ckpt, marker = tmp_path / "ckpt", tmp_path / "held"
    proc = _trainer(spec, ckpt, killed_out, held=marker)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, f"ended before step {HOLD_AT}'s host step: {_err(killed_out)}"
            assert time.monotonic() < deadline, f"no host step of step {HOLD_AT} after 120 s"
            time.sleep(0.02)
        assert marker.read_text().startswith("spill-host-step")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    killed = _lines(killed_out)
    assert [s for s, _ in checkpoint_steps(ckpt)] == [EVERY], "the step-5 checkpoint, and nothing after it"
    assert [ln["data"]["step"] for ln in killed if ln.get("event") == "checkpoint"] == [EVERY]
    ran = _steps(_series(killed)["loss"])
    # the kill can land before or after step HOLD_AT's own lines (its step is launched before the
    # training thread prints them)
    assert ran in (list(range(1, HOLD_AT)), list(range(1, HOLD_AT + 1))), ran

    # the attempt after the kill: the same command on the same folder
    resumed_proc = _trainer(spec, ckpt, resumed_out)
    assert resumed_proc.wait(timeout=300) == 0, _err(resumed_out)
    assert ref.wait(timeout=300) == 0, _err(ref_out)
    resumed, want = _lines(resumed_out), _series(_lines(ref_out))
    assert f"resumed from step-{EVERY:08d}.pt at step {EVERY}" in [ln.get("message") for ln in resumed]
    (start,) = [ln["data"] for ln in resumed if ln.get("event") == "start"]
    assert start["start_step"] == EVERY and start["optimizer_on"] == "host" and start["shards"] == 4
    assert start["shard0_steps_on_device"] is False, "every shard's state must be on the host"

    # every step after the checkpoint once, from the resumed run; stored as the worker stores them
    # (db/ingest.py: one point per (name, step), a later line replacing an earlier one), the two
    # attempts give the uninterrupted series, values bit for bit
    got = _series(resumed)
    assert set(got) == set(want)
    stored: dict[str, dict[int, float]] = {}
    for name, points in want.items():
        after = [p for p in points if p[0] > EVERY]
        assert _steps(got[name]) == _steps(after), name
        for step, value in [*_series(killed).get(name, []), *got[name]]:
            stored.setdefault(name, {})[step] = value
        assert sorted(stored[name]) == _steps(points), name
        if name not in MEASURED:
            assert [stored[name][s] for s in sorted(stored[name])] == [v for _, v in points], name
            # the steps run again after the kill gave what they gave before it
            replayed = [p for p in _series(killed).get(name, []) if p[0] > EVERY]
            assert replayed == got[name][: len(replayed)], name

    (result,) = [ln["data"] for ln in resumed if ln["kind"] == "result"]
    (want_result,) = [ln["data"] for ln in _lines(ref_out) if ln["kind"] == "result"]
    assert result["steps"] == STEPS and result["final_loss"] == want_result["final_loss"]

    # the final weights and host optimizer state, bit for bit
    final = load_checkpoint(checkpoint_path(ckpt, STEPS))
    ref_final = load_checkpoint(checkpoint_path(tmp_path / "ref-ckpt", STEPS))
    assert final["model"].keys() == ref_final["model"].keys()
    for name, value in ref_final["model"].items():
        assert torch.equal(final["model"][name], value), name
    states, ref_states = final["optimizer"]["state"], ref_final["optimizer"]["state"]
    assert states.keys() == ref_states.keys() and len(states) == len(final["model"])
    for i, ref_state in ref_states.items():
        assert states[i].keys() == ref_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in ref_state.items():
            assert torch.equal(states[i][key], value), (i, key)
        assert float(states[i]["step"]) == STEPS
