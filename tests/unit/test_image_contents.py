"""The image holds every package the project installs: each name in pyproject's package list is
copied by docker/Dockerfile and let through by .dockerignore (an image without one failed to start
its API: `No module named 'shardyard'`, found by `make test-containers`)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _packages() -> list[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return sorted(p.rstrip("*") for p in cfg["tool"]["setuptools"]["packages"]["find"]["include"])


def test_every_installed_package_is_copied_into_the_image() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, flags=re.M))
    missing = [p for p in _packages() if p not in copied]
    assert not missing, f"docker/Dockerfile does not COPY {missing}"


def test_every_installed_package_passes_the_dockerignore() -> None:
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    missing = [p for p in _packages() if p not in allowed]
    assert not missing, f".dockerignore keeps {missing} out of the build context"
