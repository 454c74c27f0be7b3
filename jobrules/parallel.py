"""The `parallel` rules of a JobSpec, in one place (standard library only): world size, schedule
names, tensor layouts, divisibility, and which combinations run. The JobSpec model (jobrules/spec.py)
calls `parallel_problems`, and the API (a 422) and the trainer (`python -m trainer` exits 2) both
validate with that model, so a spec is refused by both with the same words, or run by both as asked.

The spec is the JobSpec as a plain dict (the JobSpec model's model_dump()); every
message names the field and the numbers.

How a job's processes are laid out: world = pp x dp x tp, tp = size (1d), q*q (2d), q*q*d (2.5d).
The global batch of train.batch_size rows is split first over data-parallel replicas (dp), then a
pipeline splits a replica's rows into micro-batches, then a 2d/2.5d tensor grid splits a
micro-batch's rows over d*q row blocks. Each split must be exact.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from jobrules.data import spec_vocab_size
from jobrules.models import tensor_kind_problems

Schedule = Literal["gpipe", "1f1b", "chimera", "chimera-zb", "async"]
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
"""Pipeline schedule names; chimera and chimera-zb need an even number of stages."""
TensorMode = Literal["1d", "2d", "2.5d"]
TENSOR_MODES: tuple[TensorMode, ...] = get_args(TensorMode)
"""1d: Megatron (size ranks); 2d: SUMMA on a q x q grid; 2.5d: Tesseract on q x q x d."""


def tensor_world_size(tensor: dict[str, Any] | None) -> int:
    if not tensor:
        return 1
    mode = tensor.get("mode", "1d")
    if mode == "1d":
        return int(tensor.get("size", 1))
    q, d = int(tensor.get("q", 1)), int(tensor.get("d", 1))
    return q * q if mode == "2d" else q * q * d


def axis_sizes(parallel: dict[str, Any]) -> tuple[int, int, int]:
    """(pp, dp, tp): pipeline stages, data-parallel replicas, tensor ranks."""
    pipe = parallel.get("pipeline")
    pp = int(pipe.get("stages", 1)) if pipe else 1
    return pp, int(parallel.get("data_parallel", 1)), tensor_world_size(parallel.get("tensor"))


def checkpoint_pieces(parallel: dict[str, Any]) -> int:
    """Files one checkpoint of the job is written as: a piece per pipeline stage and tensor rank
    (data-parallel replicas write none of their own), 1 when it is one file."""
    pp, _, tp = axis_sizes(parallel)
    return pp * tp


def world_size(parallel: dict[str, Any]) -> int:
    """Processes the job needs: pipeline stages x data-parallel replicas x tensor ranks."""
    pp, dp, tp = axis_sizes(parallel)
    return pp * dp * tp


def tensor_split(tensor: dict[str, Any]) -> tuple[int, int, str]:
    """(how many ways d_model/heads/vocab are cut, how many row blocks the rows are cut into, the
    field that sets the first)."""
    mode = tensor.get("mode", "1d")
    if mode == "1d":
        return int(tensor.get("size", 1)), 1, "parallel.tensor.size"
    q, d = int(tensor.get("q", 1)), int(tensor.get("d", 1))
    return q, (q if mode == "2d" else q * d), "parallel.tensor.q"


def parallel_problems(spec: dict[str, Any]) -> list[str]:
    """Every `parallel` rule this spec breaks (empty when it runs as asked)."""
    problems: list[str] = []
    model, train = spec.get("model", {}), spec.get("train", {})
    par: dict[str, Any] = spec.get("parallel") or {}
    sections: list[dict[str, Any]] = [par.get(k) or {} for k in ("pipeline", "tensor", "spill", "offload")]
    pipe, tensor, spill, offload = sections  # an absent section is empty
    pp, dp, tp = axis_sizes(par)
    n_layers = int(model.get("layers", 4)) + 2  # embedding and head are layers too
    batch = int(train.get("batch_size", 16))

    if dp < 1:
        problems.append(f"parallel.data_parallel must be >= 1, got {dp}")
        return problems
    if pipe:
        if pipe.get("schedule", "1f1b") not in SCHEDULES:
            problems.append(
                f"parallel.pipeline.schedule must be one of {', '.join(SCHEDULES)}, got {pipe.get('schedule')!r}"
            )
        if str(pipe.get("schedule", "")).startswith("chimera") and pp % 2:
            problems.append(
                f"parallel.pipeline.stages must be even for {pipe['schedule']} "
                f"(two pipelines in opposite directions), got {pp}"
            )
    if tensor and tensor.get("mode", "1d") not in TENSOR_MODES:
        problems.append(f"parallel.tensor.mode must be 1d, 2d or 2.5d, got {tensor.get('mode')!r}")
        return problems

    # rows: batch -> dp replicas -> micro-batches -> tensor row blocks
    rows = batch
    if dp > 1:
        if batch % dp:
            problems.append(
                f"train.batch_size ({batch}) must be divisible by parallel.data_parallel ({dp}): "
                "each replica takes an equal share of the rows"
            )
        rows = max(1, batch // dp)
    if pp > 1:
        micro = int(pipe.get("microbatches", 1))
        if pp > n_layers:
            problems.append(
                f"parallel.pipeline.stages ({pp}) must be <= the model's layers "
                f"({model.get('layers')} blocks + embedding + head = {n_layers})"
            )
        if rows % micro:
            what = (
                "train.batch_size"
                if dp == 1
                else f"a replica's rows (train.batch_size / data_parallel = {rows})"
            )
            problems.append(f"parallel.pipeline.microbatches ({micro}) must divide {what} ({rows})")
        rows = max(1, rows // micro)
    if tensor and tp > 1:
        problems += _tensor_problems(spec, tensor, rows=rows, batch=batch, pp=pp)
    problems += _combination_problems(train, spill=spill, offload=offload, several=pp > 1 or tp > 1 or dp > 1)
    return problems


def _tensor_problems(
    spec: dict[str, Any], tensor: dict[str, Any], *, rows: int, batch: int, pp: int
) -> list[str]:
    """The tensor-parallel rules of a layout that splits by tensor: the widths the split divides,
    and the `rows` of one micro-batch per replica, which the grid's row blocks divide."""
    problems: list[str] = []
    model = spec.get("model", {})
    split, row_blocks, field = tensor_split(tensor)
    # which model kinds have a form in this mode, and their own divisibility rules
    problems.extend(tensor_kind_problems(model, mode=tensor["mode"], split=split))
    d_model, heads = int(model.get("d_model", 128)), int(model.get("heads", 4))
    ffn = int(model.get("mlp_ratio", 4)) * d_model
    for name, value in (
        ("model.heads", heads),
        ("model.d_model", d_model),
        # (a Llama's SwiGLU width is checked by tensor_kind_problems)
        ("the MLP width (mlp_ratio * d_model)", ffn if model.get("kind", "gpt") == "gpt" else None),
        # the vocabulary, where the API can know it (else the trainer checks it from the data)
        ("the vocabulary", spec_vocab_size(spec)),
    ):
        if value is not None and value % split:
            problems.append(f"{name} ({value}) must be divisible by {field} ({split}) for {tensor['mode']}")
    if rows % row_blocks:
        if rows == batch:
            what = "train.batch_size"
        else:
            what = "a replica's rows" if pp == 1 else "the rows of one micro-batch per replica"
        formula = "q" if tensor["mode"] == "2d" else "d*q"
        problems.append(
            f"{what} ({rows}) must be divisible by {formula} ({row_blocks}) for {tensor['mode']}: "
            "the grid splits the rows"
        )
    return problems


HOST_STEPS_WITH_OFFLOAD = (
    'parallel.spill.optimizer "host" keeps the optimizer state in host memory and steps it there; '
    "parallel.offload.optimizer streams it through the device instead: choose one"
)


def spill_state_on_host(par: dict[str, Any]) -> bool:
    """A spilled single job's optimizer state stays in host memory and the CPU steps it
    (`parallel.spill.optimizer` "host", or "auto" without the offloaded optimizer, which streams
    the state through the device instead). A selection batch's trials never: shard alternation
    moves the state with the shards."""
    spill, offload = par.get("spill") or {}, par.get("offload") or {}
    if not spill:
        return False
    mode = spill.get("optimizer", "auto")
    return mode == "host" or (mode == "auto" and not offload.get("optimizer"))


def _combination_problems(
    train: dict[str, Any], *, spill: dict[str, Any], offload: dict[str, Any], several: bool
) -> list[str]:
    """Combinations: each one either runs composed (trainer/parallelize.py) or is refused here.
    `several`: the layout has more than one process (pipeline, tensor or data parallelism)."""
    problems: list[str] = []
    offloaded = bool(offload and offload.get("optimizer"))
    if spill and several:
        problems.append(
            "parallel.spill runs on one process only: spilling drives its own shard-by-shard forward "
            "and backward over the whole model, which a pipeline stage, a tensor-parallel layer or a "
            "data-parallel gradient reduction cannot step into; use parallel.offload (optimizer state "
            "in host memory) with pipeline, tensor or data parallelism"
        )
    if spill and spill.get("optimizer") == "host" and offloaded:
        problems.append(HOST_STEPS_WITH_OFFLOAD)
    if offloaded and train.get("optimizer", "adamw") != "adamw":
        problems.append(
            f"parallel.offload.optimizer streams AdamW state through the device; train.optimizer is "
            f"{train.get('optimizer')!r} (use adamw)"
        )
    if offloaded and offload.get("dtype", "bf16") == "fp16" and several:
        problems.append(
            "parallel.offload.dtype fp16 needs dynamic loss scaling, which only the single-process "
            "engine runs; use bf16 or fp32 with pipeline, tensor or data parallelism"
        )
    return problems
