"""What a Slurm pool says to Slurm and reads back (core/slurm.py), without a cluster; the pool on a
real one is tests/slurm (make test-slurm)."""

from __future__ import annotations

import json

import pytest

from core.slurm import (
    SlurmPool,
    SlurmSettings,
    is_pool_node,
    job_of_name,
    parse_squeue,
    pending_reason,
    pool_of,
    sbatch_command,
    sizing,
)

POOL = SlurmPool(
    name="a100", partition="gpu", account="ml", qos="high", nodes=4, python="/opt/py", workdir="/opt/sy"
)


def test_settings_read_the_pools_from_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDYARD_SLURM_POOLS", json.dumps([{"name": "p", "nodes": 2, "gpus_per_node": 4}]))
    monkeypatch.setenv("SHARDYARD_SLURM_POLL_S", "0.5")
    conf = SlurmSettings()
    assert conf.poll_s == 0.5
    (pool,) = conf.pools
    assert pool.node_names == ["slurm:p:0", "slurm:p:1"]
    assert pool.queues() == ["cpu", "gpu"]


def test_node_names() -> None:
    assert is_pool_node("slurm:a100:3") and not is_pool_node("worker1@host") and not is_pool_node(None)
    assert pool_of("slurm:a100:3") == "a100" and pool_of("worker1@host") is None
    assert job_of_name(POOL, "shardyard-17") == 17
    assert job_of_name(POOL, "shardyard-17x") is None and job_of_name(POOL, "other-17") is None


def test_the_sbatch_command_is_sized_from_the_reservation_and_the_spec() -> None:
    size = sizing(POOL, nnodes=2, slots=4, gpus=4, ram_bytes=3 * 2**30, max_runtime_s=7200)
    assert (size.nodes, size.tasks_per_node, size.gpus_per_node, size.mem_mb) == (2, 4, 4, 3072)
    assert size.minutes == 120 + 1 + 1  # the run, the signal's lead, a minute to settle
    args, script = sbatch_command(POOL, job_id=17, size=size, priority=30, output="/d/slurm/job-17-%j.out")
    for want in (
        "--job-name=shardyard-17",
        "--nodes=2",
        "--ntasks-per-node=4",
        "--gres=gpu:4",
        "--mem=3072M",
        "--time=122",
        "--requeue",
        "--signal=USR1@60",
        "--nice=70",
        "--partition=gpu",
        "--account=ml",
        "--qos=high",
        "--chdir=/opt/sy",
        "--output=/d/slurm/job-17-%j.out",
    ):
        assert want in args, want
    assert script.splitlines()[-1] == (
        "exec srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=4 --kill-on-bad-exit=0 "
        "/opt/py -m workers.slurm_agent --job 17"
    )


def test_no_gres_without_gpus_and_the_pools_time_limit_without_max_runtime() -> None:
    pool = SlurmPool(name="cpu", time_limit_s=600)
    size = sizing(pool, nnodes=1, slots=1, gpus=0, ram_bytes=10, max_runtime_s=None)
    args, _ = sbatch_command(pool, job_id=1, size=size, priority=0, output="o")
    assert not [a for a in args if a.startswith(("--gres", "--partition", "--account", "--qos"))]
    assert "--time=12" in args and "--mem=256M" in args and "--nice=100" in args


def test_squeue_lines_name_the_pools_jobs_only() -> None:
    text = "\n".join(
        [
            "40|shardyard-7|PENDING|Resources|",
            "41|shardyard-8|RUNNING|None|n[1-2]",
            "42|someone-elses|RUNNING|None|n1",
            "43|shardyard-7|PENDING|BeginTime|",
            "garbage",
        ]
    )
    got = parse_squeue(POOL, text)
    assert set(got) == {7, 8}
    assert got[7].slurm_id == 43 and got[7].reason == "BeginTime"  # the newest of two
    assert got[8].nodes == "n[1-2]"
    assert pending_reason(got[7], POOL) == "slurm job 43 pending in partition gpu: BeginTime"
