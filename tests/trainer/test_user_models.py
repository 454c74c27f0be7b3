"""The Llama-style recipe and a user's own recipe (written into a workspace folder here) under
every engine: spilled, offloaded and pipelined (2 gloo ranks) runs give the plain run's losses,
Llama runs 1-D tensor-parallel (2 gloo ranks) with the dense run's losses and is refused in 2d;
user-code mistakes fail before training with the reason; init_from loads a saved model."""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from jobrules.spec import SpecError
from tests.gloo import run_ranks
from tests.trainer.user_model_src import USER_CNN, USER_MODEL
from trainer.config import load_job
from trainer.protocol import ListSink, NeverStop
from trainer.runner import run
from trainer.workspace import UserCodeError, set_workspace

MODELS: dict[str, dict[str, Any]] = {
    "llama": {"kind": "llama", "layers": 2, "d_model": 32, "heads": 4, "kv_heads": 2, "seq_len": 16},
    "python": {
        "kind": "python",
        "entry": "userlm.model:make",
        "args": {"width": 32, "depth": 2},
        "seq_len": 16,
    },
}


def spec(model: str, **parallel: Any) -> dict[str, Any]:
    return {
        "model": MODELS[model],
        "data": {"max_chars": 40_000},
        "train": {"steps": 4, "batch_size": 4, "lr": 1e-2, "eval_every": 4, "eval_batches": 1},
        "parallel": parallel,
        "resources": {"device": "cpu"},
    }


def make_workspace(root: Path) -> Path:
    (root / "userlm").mkdir(parents=True, exist_ok=True)
    (root / "userlm" / "__init__.py").write_text("")
    (root / "userlm" / "model.py").write_text(USER_MODEL)
    (root / "cnn.py").write_text(USER_CNN)
    return root


def losses(raw: dict[str, Any], workspace: Path | None) -> tuple[list[float], dict[str, Any]]:
    set_workspace(workspace)
    try:
        sink = ListSink()
        result = run(load_job(raw), sink=sink, stop=NeverStop())
        return sink.series("loss"), result
    finally:
        set_workspace(None)
        for name in ("userlm.model", "userlm", "cnn"):
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("ws"))


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_spilled_and_offloaded_runs_match_the_plain_run(model: str, workspace: Path) -> None:
    plain, _ = losses(spec(model), workspace)
    assert all(torch.isfinite(torch.tensor(plain)))
    spilled, result = losses(spec(model, spill={"device_budget_mb": 0.5, "prefetch": True}), workspace)
    assert result["shards"] >= 2, result
    torch.testing.assert_close(torch.tensor(spilled), torch.tensor(plain))
    offloaded, result = losses(spec(model, offload={"optimizer": True, "dtype": "fp32"}), workspace)
    assert result["offload"] == "fp32"
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(plain), rtol=1e-4, atol=1e-5)


def _ranks(rank: int, world: int, root: str) -> dict[str, list[float]]:
    out = {}
    for model in sorted(MODELS):
        raw = spec(model, pipeline={"stages": 2, "microbatches": 2, "schedule": "1f1b"})
        out[f"pp-{model}"] = losses(raw, Path(root))[0]
    out["tp-llama"] = losses(spec("llama", tensor={"mode": "1d", "size": 2}), None)[0]
    return out


@functools.cache
def _distributed() -> list[dict[str, list[float]]]:
    with tempfile.TemporaryDirectory() as root:
        make_workspace(Path(root))
        return run_ranks(_ranks, world_size=2, args=(root,), timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
def test_pipelined_runs_match_the_plain_run(model: str, workspace: Path) -> None:
    """Two gloo ranks stand in for two GPUs: what this proves for NCCL is that the stage split of a
    recipe's layers and the loss over micro-batches give the single-process numbers."""
    plain, _ = losses(spec(model), workspace)
    piped = _distributed()[0][f"pp-{model}"]
    torch.testing.assert_close(torch.tensor(piped), torch.tensor(plain), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_llama_1d_tensor_parallel_matches_the_dense_run() -> None:
    """Heads, key/value heads, the SwiGLU width and the vocabulary split over 2 gloo ranks; the
    collectives are the 1-D layers' (all-reduce and all-gather on device tensors)."""
    plain, _ = losses(spec("llama"), None)
    torch.testing.assert_close(
        torch.tensor(_distributed()[0]["tp-llama"]), torch.tensor(plain), rtol=1e-4, atol=1e-5
    )


def test_llama_2d_tensor_parallel_is_refused_with_the_reason() -> None:
    from api.schemas import JobSpec

    raw = spec("llama", tensor={"mode": "2d", "q": 2})
    with pytest.raises(ValueError, match="mode 2d has no form for model.kind llama"):
        JobSpec.model_validate(raw)
    with pytest.raises(SpecError, match="mode 2d has no form for model.kind llama"):
        from trainer.tensor.grid import check_tensor_layout

        job = load_job(raw)
        check_tensor_layout(job.parallel.tensor, world_size=4, model=job.model, batch_size=4)


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("userlm.model:not_a_recipe", "must return a trainer.recipe.ModelRecipe, got Linear"),
        ("userlm.model:mismatched", r"layer 1 \(Linear\) failed on an input of shape \(4, 16, 16\)"),
        ("userlm.model:nothing", "module userlm.model has no attribute 'nothing'"),
        ("userlm.nomodule:make", "no module 'userlm.nomodule'"),
    ],
)
def test_user_code_mistakes_fail_before_training(workspace: Path, entry: str, reason: str) -> None:
    raw = spec("python")
    raw["model"] = {**raw["model"], "entry": entry, "args": {}}
    with pytest.raises(UserCodeError, match=reason):
        losses(raw, workspace)


def test_a_user_model_that_cannot_fit_the_spill_budget_fails_at_once(workspace: Path) -> None:
    with pytest.raises(SpecError, match="device_budget_mb"):
        losses(spec("python", spill={"device_budget_mb": 0.01}), workspace)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_init_from_loads_saved_weights(tmp_path: Path, fmt: str) -> None:
    from safetensors.torch import save_file

    from trainer.models import build_model

    job = load_job(spec("llama"))
    dense = build_model(job.model, seed=123)
    state = {k: v.contiguous() for k, v in dense.state_dict().items()}
    path = tmp_path / f"w.{fmt}"
    save_file(state, str(path)) if fmt == "safetensors" else torch.save({"model": state}, path)
    raw = spec("llama")
    raw["model"] = {**raw["model"], "init_from": str(path)}
    loaded = build_model(load_job(raw).model, seed=0)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, state[k])
    raw["model"]["d_model"] = 64
    with pytest.raises(
        SpecError, match=r"'0.tok.weight' has shape \(128, 32\) in the file, \(128, 64\) in the model"
    ):
        build_model(load_job(raw).model, seed=0)


def test_a_cnn_on_python_image_data_spilled_and_offloaded(workspace: Path) -> None:
    """Neither the inputs nor the loss are tokens: the spilling engine sizes and runs the recipe's
    own batch (feed) and loss; three shards and the offloaded optimizer match the plain run."""
    raw = {
        "model": {"kind": "python", "entry": "cnn:make", "args": {"width": 8}},
        "data": {"kind": "python", "entry": "cnn:images"},
        "train": {"steps": 24, "batch_size": 16, "lr": 1e-2, "eval_every": 24, "eval_batches": 2},
        "resources": {"device": "cpu"},
    }
    plain, _ = losses(raw, workspace)
    assert plain[-1] < plain[0] - 0.5, plain
    spilled, result = losses(
        {**raw, "parallel": {"spill": {"device_budget_mb": 1, "cuts": [1, 2]}}}, workspace
    )
    assert result["shards"] == 3
    torch.testing.assert_close(torch.tensor(spilled), torch.tensor(plain))
    offloaded, _ = losses({**raw, "parallel": {"offload": {"optimizer": True, "dtype": "fp32"}}}, workspace)
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(plain), rtol=1e-4, atol=1e-5)


def test_selection_trials_size_with_the_recipe_batch_and_loss(workspace: Path) -> None:
    """A spilled selection trial's cost trial runs the recipe's own batch and loss, as the spilling
    engine's does (it used to feed zero token ids to cross entropy, which a CNN cannot even run):
    its shards' working sets equal those of the spilling engine's costs for the same job."""
    from trainer.data import with_data_vocab
    from trainer.models import recipe_for
    from trainer.recipe import build_dense
    from trainer.selection.shards import ShardedTrial
    from trainer.spill.job import plan_job
    from trainer.spill.partition import working_set

    raw = {
        "model": {"kind": "python", "entry": "cnn:make", "args": {"width": 8}},
        "data": {"kind": "python", "entry": "cnn:images"},
        "train": {"steps": 2, "batch_size": 16},
        # a trial's state moves with its shards: size the job the same way
        "parallel": {"spill": {"device_budget_mb": 1, "cuts": [1, 2], "optimizer": "device"}},
        "resources": {"device": "cpu"},
    }
    set_workspace(workspace)
    try:
        job = with_data_vocab(load_job(raw))
        trial = ShardedTrial.build(job, index=0, budget_bytes=None, prefetch=False)
        recipe = recipe_for(job.model)
        plan, _ = plan_job(job, build_dense(recipe, seed=0), device=torch.device("cpu"), recipe=recipe)
    finally:
        set_workspace(None)
        sys.modules.pop("cnn", None)
    assert len(trial.shards) == plan.n_shards == 3
    assert trial.work_bytes == [working_set(plan.costs, start=a, stop=b) for a, b in plan.bounds]
    # the classifier's loss is over (batch, classes) logits, not (batch, seq_len, vocabulary)
    assert plan.costs[-1].out_bytes == 16 * 4 * 4
