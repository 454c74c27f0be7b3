"""The compose recipe's container settings (docker/compose.yaml, docs/deploy.md): every Shardyard
service without capabilities or setuid gains, the API and the scheduler with a read-only root, and
the workers with what the trainers' sandbox needs (tests/containers runs the same settings under
podman)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SANDBOX = {"systempaths=unconfined", "seccomp=unconfined"}


def test_every_shardyard_service_is_hardened_and_only_the_workers_can_sandbox() -> None:
    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    ours = {name: s for name, s in services.items() if "SHARDYARD_" in s["image"]}
    assert {"api", "scheduler", "worker", "gpu-worker"} <= set(ours)
    for name, s in ours.items():
        assert s["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in s["security_opt"], name
        if name in ("worker", "gpu-worker"):
            assert SANDBOX <= set(s["security_opt"]), name
        else:
            assert not SANDBOX & set(s["security_opt"]), f"{name} runs no users' code"
    for name in ("api", "scheduler"):
        assert services[name]["read_only"] is True and services[name]["tmpfs"] == ["/tmp"], name
