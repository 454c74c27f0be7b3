"""A spilled job through the one entry point (trainer.runner.run) gives the plain run's numbers and
emits the memory metrics; stop and checkpoint/resume behave like the plain run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from jobrules.sizing import layer_working_sets
from tests.trainer.stops import StopAfterLosses
from trainer.config import load_job
from trainer.protocol import ListSink, NeverStop
from trainer.runner import run

BASE: dict[str, Any] = {
    "model": {"kind": "gpt", "layers": 3, "d_model": 32, "heads": 4, "seq_len": 16},
    "data": {"max_chars": 100_000},
    "train": {"steps": 20, "batch_size": 4, "lr": 1e-2, "eval_every": 10, "eval_batches": 2},
    "resources": {"device": "cpu"},
}
BUDGET_MB = 0.6  # between one block's working set (~0.36 MiB) and the whole model's (~1.2 MiB)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def spec(**over: Any) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for k, v in over.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


@pytest.mark.parametrize("optimizer", ["device", "auto"])
def test_runner_dispatches_and_losses_equal_loop_train(optimizer: str) -> None:
    """With the state on the device the run is the loop's to the bit; on the host (the default) the
    host's fused optimizer rounds its last bit otherwise (tests/trainer/test_spill_host.py holds it
    to a fused resident run exactly)."""
    ref = ListSink()
    run(load_job(spec()), sink=ref, stop=NeverStop())
    sink = ListSink()
    job = load_job(
        spec(parallel={"spill": {"device_budget_mb": BUDGET_MB, "prefetch": True, "optimizer": optimizer}})
    )
    result = run(job, sink=sink, stop=NeverStop())
    if optimizer == "device":
        assert sink.series("loss") == ref.series("loss")
        assert result["optimizer_on"] == "device"
    else:
        assert sink.series("loss") == pytest.approx(ref.series("loss"), rel=1e-6)
        assert result["optimizer_on"] == "host"
    assert sink.series("val_loss") == pytest.approx(ref.series("val_loss"), rel=1e-6)
    assert result["shards"] >= 2 and result["cuts"] and result["prefetch"] is True
    assert 0 < result["ledger_peak_mb"] <= BUDGET_MB
    peaks, resident = sink.series("ledger_peak_mb"), sink.series("resident_shards")
    assert len(peaks) == len(resident) == 20
    # the running shard and the prefetched one; on the host, shard 0 too where it stays
    most = 3.0 if result["shard0_steps_on_device"] and optimizer == "auto" else 2.0
    assert max(peaks) <= BUDGET_MB and max(resident) == most
    for name in ("step_time_ms", "tokens_per_s", "peak_mem_mb"):
        assert len(sink.series(name)) == 20
    assert sink.results == [result]


def test_offload_only_job_runs_one_resident_shard() -> None:
    sink = ListSink()
    job = load_job(spec(parallel={"offload": {"optimizer": True, "dtype": "bf16"}}))
    result = run(job, sink=sink, stop=NeverStop())
    assert result["shards"] == 1 and result["offload"] == "bf16" and result["budget_mb"] is None
    losses = sink.series("loss")
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("optimizer", ["device", "host"])
def test_prefetch_is_turned_off_when_only_one_shard_at_a_time_fits(optimizer: str) -> None:
    shape = dict(BASE["model"], batch_size=4)
    single_max = max(layer_working_sets(**shape, host_state=optimizer == "host")) / 2**20
    budget = single_max * 1.01  # one layer fits, a layer plus its neighbour's params does not
    sink = ListSink()
    job = load_job(
        spec(
            train={"steps": 3},
            parallel={"spill": {"device_budget_mb": budget, "prefetch": True, "optimizer": optimizer}},
        )
    )
    result = run(job, sink=sink, stop=NeverStop())
    assert result["prefetch"] is False and result["shards"] == 5
    assert any("prefetch turned off" in line for line in sink.logs)
    assert result["ledger_peak_mb"] <= budget


def test_budget_below_one_layer_is_a_config_error() -> None:
    from jobrules.spec import SpecError

    # the shared sizing rule (jobrules/sizing.py) refuses it before anything runs, in the API's words
    with pytest.raises(
        SpecError, match=r"device_budget_mb \(0\.1\) is smaller than the largest single layer"
    ):
        load_job(spec(parallel={"spill": {"device_budget_mb": 0.1}}))


def test_stop_and_resume_give_the_uninterrupted_numbers(tmp_path: Path) -> None:
    ref = ListSink()
    run(load_job(spec()), sink=ref, stop=NeverStop())
    par = {"spill": {"device_budget_mb": BUDGET_MB}}
    first = ListSink()
    job = load_job(spec(parallel=par, checkpoint_every=5))
    r1 = run(job, sink=first, stop=StopAfterLosses(first, 7), checkpoint_dir=tmp_path)
    assert r1["stopped"] is True and r1["steps"] == 7
    assert [e for e, _ in first.events].count("checkpoint") == 1
    # resume from the step-7 checkpoint with other cuts; then the plain engine can continue it too
    second = ListSink()
    job2 = load_job(spec(parallel={"spill": {"device_budget_mb": 2.0, "cuts": [2]}}))
    run(job2, sink=second, stop=NeverStop(), checkpoint_dir=tmp_path)
    assert "resumed from step-00000007.pt at step 7" in second.logs
    torch.testing.assert_close(
        torch.tensor(first.series("loss") + second.series("loss")), torch.tensor(ref.series("loss"))
    )
    third = ListSink()
    run(load_job(spec(train={"steps": 22})), sink=third, stop=NeverStop(), checkpoint_dir=tmp_path)
    assert "resumed from step-00000020.pt at step 20" in third.logs
    assert len(third.series("loss")) == 2


def test_grad_clip_job_equals_loop_train() -> None:
    """With several shards grad_clip takes the engine's deferred-step path; same losses."""
    ref = ListSink()
    run(load_job(spec(train={"steps": 8, "grad_clip": 0.5})), sink=ref, stop=NeverStop())
    sink = ListSink()
    job = load_job(
        spec(train={"steps": 8, "grad_clip": 0.5}, parallel={"spill": {"device_budget_mb": BUDGET_MB}})
    )
    result = run(job, sink=sink, stop=NeverStop())
    assert result["shards"] >= 2
    torch.testing.assert_close(torch.tensor(sink.series("loss")), torch.tensor(ref.series("loss")))


def test_the_allocator_baseline_leaves_out_the_workspaces_the_plan_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA (faked: no GPU here) the plan clears the cuBLAS workspaces the process holds (an
    earlier run's: another job in the same process, test or bench row) and makes this run's; the
    ledger holds them, so the allocator's baseline, which cuda_peak_mb and untracked_mb subtract,
    must not. It used to be read before the plan, with the earlier run's workspaces in it: the
    run's allocator peak then left its own workspaces out."""
    from types import SimpleNamespace

    import trainer.spill.job as sj
    from trainer.models import recipe_for

    mib = 2**20
    held = {"other": 3 * mib, "workspaces": 64 * mib}  # what the process held before this job

    def clear() -> None:
        held["workspaces"] = 0

    def measure(device: torch.device) -> int:  # partition.library_workspace_bytes on a GPU
        clear()
        held["workspaces"] = 64 * mib
        return 64 * mib

    measure_layers = sj.measure_layers
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: sum(held.values()))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", clear, raising=False)
    monkeypatch.setattr(sj, "library_workspace_bytes", measure)
    monkeypatch.setattr(
        sj, "measure_layers", lambda model, **kw: measure_layers(model, **{**kw, "device": "meta"})
    )
    monkeypatch.setattr(
        sj, "SpillEngine", lambda *a, **kw: SimpleNamespace(offloaded=False, host=None, anchor=False)
    )
    job = load_job(spec(parallel={"spill": {"device_budget_mb": 64 + BUDGET_MB}}))
    engine = sj.SpilledEngine(job, recipe=recipe_for(job.model), sink=ListSink(), device=torch.device("cuda"))
    assert engine.plan.reserved_bytes == 64 * mib and engine.plan.n_shards >= 2
    assert engine.base == 3 * mib
