"""The limits a worker puts on a trainer process: a real child process under a real RLIMIT_AS, and
the host-memory estimate admission and the limit share."""

from __future__ import annotations

import sys
from pathlib import Path

from jobrules.hostmem import RANK_RUNTIME_BYTES, host_memory_bytes
from jobrules.spec import parse_job, stored_job
from tests.conftest import TINY_SPEC
from workers.limits import GiB, memory_limit_bytes, out_of_memory_error, runtime_limit_s
from workers.supervise import Outcome, run_unattended

SPEC = {
    **TINY_SPEC,
    "train": {**TINY_SPEC["train"], "optimizer": "adamw"},
    "model": {**TINY_SPEC["model"], "kind": "gpt", "vocab_size": 128, "mlp_ratio": 4},
    "data": {"max_chars": 200_000},
    "parallel": {},
    "resources": {"device": "cpu", "gpus": 0},
}


def test_a_trainer_past_its_memory_limit_fails_alone_with_out_of_host_memory(tmp_path: Path) -> None:
    # torch asks for 8 GiB under a 2 GiB address-space limit: the allocation fails in the child
    grab = "import torch; torch.ones(2**31, dtype=torch.float32)"
    out = Outcome()
    rc = run_unattended(
        [sys.executable, "-c", grab],
        tmp_path,
        grace_s=5,
        out=out,
        on_message=lambda _msg: None,
        memory_limit=2 * GiB,
    )
    assert rc != 0
    msg = out_of_memory_error(error=None, stderr_tail=list(out.stderr_tail), limit=2 * GiB)
    assert msg is not None and msg.startswith("out of host memory") and "2.0 GiB" in msg
    # any other failure keeps its own message
    assert out_of_memory_error(error="loss is NaN", stderr_tail=[], limit=2 * GiB) is None


def test_estimate_counts_parameters_optimizer_activations_and_ranks() -> None:
    one = host_memory_bytes(SPEC)
    assert one["runtime"] == RANK_RUNTIME_BYTES + 200_000  # the char corpus: one byte a token
    sgd = host_memory_bytes({**SPEC, "train": {**SPEC["train"], "optimizer": "sgd"}})
    assert one["model_state"] == 2 * sgd["model_state"]  # 16 vs 8 bytes per parameter
    piped = {**SPEC, "parallel": {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "chimera"}}}
    two = host_memory_bytes(piped)
    assert two["model_state"] == 2 * one["model_state"]  # Chimera's two replicas
    assert two["runtime"] == 2 * one["runtime"]
    assert (
        memory_limit_bytes(parse_job(piped), ram_bytes=64 * GiB) == two["total"] + 3 * GiB
    )  # 2x share x 2 ranks
    assert memory_limit_bytes(parse_job({**SPEC, "resources": {"device": "cuda", "gpus": 1}})) is None


def test_runtime_limit_is_the_jobs_own_within_the_services() -> None:
    assert runtime_limit_s(stored_job({"max_runtime_s": 30}), service_max_s=100) == 30
    assert runtime_limit_s(stored_job({"max_runtime_s": 300}), service_max_s=100) == 100
    assert runtime_limit_s(stored_job({}), service_max_s=100) == 100


def test_a_selection_groups_limit_sums_its_trials_estimates() -> None:
    """A group's trials all live in its one process, so its limit is twice the sum of their
    estimates plus one runtime margin, capped by the machine's RAM; CUDA groups get none."""
    from workers.limits import MARGIN_BYTES, group_memory_limit_bytes

    big = {**SPEC, "model": {**SPEC["model"], "d_model": 64}}
    docs = [SPEC, SPEC, big]
    specs = [stored_job(s) for s in docs]  # as a worker reads its trials' stored specs
    ram = 2**40
    want = 2 * sum(host_memory_bytes(s)["total"] for s in docs) + MARGIN_BYTES
    assert group_memory_limit_bytes(specs, ram_bytes=ram) == want
    assert memory_limit_bytes(specs[0], ram_bytes=ram) < want  # more than any one trial's
    assert group_memory_limit_bytes(specs, ram_bytes=2**30) == MARGIN_BYTES  # never past the RAM
    cuda = stored_job({**SPEC, "resources": {"device": "cuda", "gpus": 1}})
    assert group_memory_limit_bytes([specs[0], cuda]) is None
