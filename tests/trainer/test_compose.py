"""Composed parallelism on real gloo ranks against the single-process reference: the losses of every
step, the validation loss, and every parameter piece each rank holds after training (cut from the
reference's dense weights the way the rank's layout cuts them) agree with torch.testing.assert_close.

Layouts: dp=2; pp=2 x dp=2; pp=2 x tp(1d)=2; tp(2d, q=2) x dp=2 (8 ranks); pp=2 + offloaded AdamW
(fp32, so it must match torch's AdamW to rounding); the message-driven (async) pipeline x dp=2 (each
pipeline makes its own channel groups); Chimera pp=2 x dp=2 with gradient clipping at a norm that
does clip (a norm summed over WORLD instead of one replica's ranks would clip differently and fail);
the tensor layouts clip too (each replicated tensor piece counted once, pipeline stages summed).

What this proves for NCCL: the ranks issue the same collectives in the same order with device-side
tensors (gradient buckets, the loss all-reduce, the clip norm); gloo would also accept CPU tensors,
so the NCCL rule itself is kept by construction in trainer/grads.py and trainer/engine.py, not by
this test. Pipeline messages still go through trainer/pipeline/driver.py.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from jobrules.spec import SpecError
from tests.gloo import run_ranks
from tests.trainer.stops import StopAfter
from trainer.config import load_job
from trainer.data import TextData
from trainer.loop import run_steps
from trainer.protocol import ListSink, NeverStop
from trainer.runner import build_engine, run

BASE: dict[str, Any] = {
    "model": {"kind": "gpt", "layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "mlp_ratio": 2},
    "data": {"max_chars": 20000},
    "train": {"steps": 3, "batch_size": 8, "lr": 1e-2, "eval_every": 3, "eval_batches": 1},
    "resources": {"device": "cpu"},
}


def spec(parallel: dict[str, Any], **train: Any) -> dict[str, Any]:
    s = copy.deepcopy(BASE)
    s["parallel"] = parallel
    s["train"].update(train)
    return s


LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "dp2": ({"data_parallel": 2}, {}, 2),
    "pp2xdp2": (
        {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}, "data_parallel": 2},
        {},
        4,
    ),
    "pp2xtp1d2": (
        {
            "pipeline": {"stages": 2, "microbatches": 2, "schedule": "gpipe"},
            "tensor": {"mode": "1d", "size": 2},
        },
        {"grad_clip": 0.05},
        4,
    ),
    "tp2dxdp2": ({"tensor": {"mode": "2d", "q": 2}, "data_parallel": 2}, {"grad_clip": 0.05}, 8),
    "pp2+offload": (
        {
            "pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"},
            "offload": {"optimizer": True, "dtype": "fp32"},
        },
        {},
        2,
    ),
    "pp2xdp2-async": (
        {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "async"}, "data_parallel": 2},
        {},
        4,
    ),
    "pp2xdp2+clip": (
        {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "chimera"}, "data_parallel": 2},
        {"grad_clip": 0.05},
        4,
    ),
}


def _reference(train: dict[str, Any]) -> dict[str, Any]:
    job = load_job(spec({}, **train))
    sink = ListSink()
    engine, recipe, _ = build_engine(job, sink=sink)
    data = TextData.from_config(job.data, seq_len=job.model.seq_len)
    run_steps(engine, job=job, recipe=recipe, data=data, sink=sink, stop=NeverStop(), checkpoint_dir=None)
    return {
        "loss": sink.series("loss"),
        "val_loss": sink.series("val_loss"),
        "state": {k: v.clone() for k, v in engine.state_dict()["model"].items()},
    }


def _rank(
    rank: int, world: int, raw: dict[str, Any], dense: dict[str, torch.Tensor], ckpt: str
) -> dict[str, Any]:
    from trainer.tensor.block import slicers

    job = load_job(raw)
    sink = ListSink()
    engine, recipe, report = build_engine(job, sink=sink)
    data = TextData.from_config(job.data, seq_len=job.model.seq_len)
    result = run_steps(
        engine, job=job, recipe=recipe, data=data, sink=report, stop=NeverStop(), checkpoint_dir=Path(ckpt)
    )
    compared = 0
    for module in engine.parts.modules.values():
        cuts = slicers(module) if engine.tp_grid is not None else {}
        for name, p in module.named_parameters():
            want = cuts[name](dense[name]) if cuts else dense[name]
            torch.testing.assert_close(
                p.detach().float(), want, rtol=2e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
            compared += p.numel()
    local = sum(p.numel() for m in engine.parts.modules.values() for p in m.parameters())
    # every rank held its own pieces only (never the whole dense model)
    return {
        "loss": sink.series("loss"),
        "val_loss": sink.series("val_loss"),
        "result": result,
        "compared": compared,
        "local": local,
    }


@functools.cache
def _ref(clip: bool) -> dict[str, Any]:
    return _reference({"grad_clip": 0.05} if clip else {})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_composed_layout_matches_the_single_process_reference(name: str) -> None:
    parallel, train, world = LAYOUTS[name]
    ref = _ref("grad_clip" in train)
    raw = spec(parallel, **train)
    with tempfile.TemporaryDirectory() as ckpt:
        ranks = run_ranks(_rank, world_size=world, args=(raw, ref["state"], ckpt), timeout_s=300)
        written = sorted(p.parent.name for p in Path(ckpt).rglob("step-*.pt"))
    lead = ranks[0]
    torch.testing.assert_close(lead["loss"], ref["loss"], rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(lead["val_loss"], ref["val_loss"], rtol=2e-4, atol=2e-5)
    assert all(r["loss"] == [] for r in ranks[1:])  # only rank 0 reports
    n_params = sum(v.numel() for v in ref["state"].values())
    assert lead["result"]["params"] == n_params
    assert all(r["compared"] == r["local"] > 0 for r in ranks)
    pp, dp, tp = load_job(raw).parallel.axes
    chimera = str(parallel.get("pipeline", {}).get("schedule", "")).startswith("chimera")
    if pp * tp > 1 and not chimera:  # (Chimera holds two stage copies per rank: all of it at D=2)
        assert all(r["local"] < n_params for r in ranks)
    # one checkpoint per model piece: the first data-parallel replica writes, the others do not
    pieces = pp * tp
    assert len(written) == pieces, written


def test_clipping_in_the_reference_really_clips() -> None:
    """The clip layout compares against a run whose norm is above 0.05 at every step."""
    clipped, free = _ref(True), _ref(False)
    assert clipped["loss"][0] == free["loss"][0] and clipped["loss"][-1] != free["loss"][-1]


def test_spill_beside_any_parallel_axis_is_refused_with_the_reason() -> None:
    for parallel in (
        {"spill": {"device_budget_mb": 64}, "pipeline": {"stages": 2, "microbatches": 2}},
        {"spill": {"device_budget_mb": 64}, "data_parallel": 2},
        {"spill": {"device_budget_mb": 64}, "tensor": {"mode": "1d", "size": 2}},
    ):
        with pytest.raises(SpecError, match="parallel.spill runs on one process only"):
            load_job(spec(parallel))


def test_a_launch_with_the_wrong_world_size_fails_before_any_process_group() -> None:
    job = load_job(spec({"data_parallel": 2}))
    with pytest.raises(SpecError, match=r"pp\*dp\*tp = 1\*2\*1 = 2 processes but WORLD_SIZE is 1"):
        run(job, sink=ListSink(), stop=NeverStop())
    assert not torch.distributed.is_initialized()


def _resume_rank(rank: int, world: int, raw: dict[str, Any], ckpt: str) -> dict[str, Any]:
    """Two steps and a stop, then the same job again from the checkpoints: replica 1 resumes from
    the files replica 0 wrote."""
    job = load_job(raw)
    first, second = ListSink(), ListSink()
    run(job, sink=first, stop=StopAfter(2), checkpoint_dir=Path(ckpt))
    files = sorted(p.name for p in Path(ckpt).rglob("step-*.pt"))
    run(job, sink=second, stop=NeverStop(), checkpoint_dir=Path(ckpt))
    return {
        "first": first.series("loss"),
        "second": second.series("loss"),
        "files": files,
        "logs": second.logs,
    }


@pytest.mark.slow
def test_data_parallel_run_resumes_from_the_first_replicas_checkpoint() -> None:
    ref = _ref(False)
    with tempfile.TemporaryDirectory() as ckpt:
        lead, other = run_ranks(
            _resume_rank, world_size=2, args=(spec({"data_parallel": 2}), ckpt), timeout_s=300
        )
    assert lead["files"] == ["step-00000002.pt"]  # one writer for the two replicas
    torch.testing.assert_close(lead["first"] + lead["second"], ref["loss"], rtol=2e-4, atol=2e-5)
    assert any(m.startswith("resumed from step-00000002.pt") for m in lead["logs"])
    assert other["first"] == other["second"] == []


def _resume_after_damage(rank: int, world: int, raw: dict[str, Any], ckpt: str) -> dict[str, Any]:
    """Four steps (checkpoints at 2 and 4), then rank 1's newest file is truncated; the same job
    again must fall back to step 2 on every rank."""
    job = load_job(raw)
    first, second = ListSink(), ListSink()
    run(job, sink=first, stop=StopAfter(4), checkpoint_dir=Path(ckpt))
    torch.distributed.barrier()
    if rank == 1:
        (newest,) = [p for p in Path(ckpt).rglob("step-00000004.pt") if p.parent.name == "pp1-tp0"]
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    torch.distributed.barrier()
    run(job, sink=second, stop=NeverStop(), checkpoint_dir=Path(ckpt))

    def losses(sink: ListSink) -> list[tuple[int, float]]:
        return [(st, v) for st, n, v in sink.metrics if n == "loss"]

    return {"first": losses(first), "second": losses(second), "logs": second.logs}


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_on_one_rank_falls_back_to_a_common_step() -> None:
    """Stage 1's newest piece is damaged, stage 0's is fine: both ranks resume from step 2 (they
    agree with an all-reduce MIN of a tensor on the engine's device: on gloo a CPU tensor, on NCCL
    the same code all-reduces a CUDA tensor) and the run goes on exactly as one never stopped."""
    ref = _reference({"steps": 6, "eval_every": 3})
    raw = spec({"pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}}, steps=6, eval_every=3)
    raw["checkpoint_every"] = 2
    with tempfile.TemporaryDirectory() as ckpt:
        lead, _ = run_ranks(_resume_after_damage, world_size=2, args=(raw, ckpt), timeout_s=300)
        aside = sorted(p.relative_to(ckpt).as_posix() for p in Path(ckpt).rglob("*.corrupt"))
    assert aside == ["pp1-tp0/step-00000004.pt.corrupt"]
    assert [st for st, _ in lead["first"]] == [1, 2, 3, 4]
    assert "resumed from step-00000002.pt at step 2" in lead["logs"]
    # steps 1-4, then 3-6 again from the common checkpoint: the same losses as one run of 6
    assert [st for st, _ in lead["second"]] == [3, 4, 5, 6]
    resumed = [v for _, v in lead["first"][:2]] + [v for _, v in lead["second"]]
    torch.testing.assert_close(resumed, ref["loss"], rtol=2e-4, atol=2e-5)
