"""`shardyard healthcheck` tells which process its container runs from PID 1's command line: the
image runs the API, the scheduler or a worker, and Celery retitles a worker's main process."""

from __future__ import annotations

import pytest

from api.healthcheck import Unhealthy, _port, role_of


@pytest.mark.parametrize(
    ("argv", "role"),
    [
        (["/opt/venv/bin/python", "/opt/venv/bin/shardyard", "serve", "--host", "0.0.0.0"], "api"),
        (["/opt/venv/bin/python", "/opt/venv/bin/shardyard", "scheduler"], "scheduler"),
        # what /proc/1/cmdline of a worker container holds once Celery has set its title
        (["[celery] -active- (-A workers.celery_app worker -Q cpu,gpu --concurrency 1)"], "worker"),
        (
            ["/opt/venv/bin/python", "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", "cpu"],
            "worker",
        ),
    ],
)
def test_the_role_comes_from_the_command_line(argv: list[str], role: str) -> None:
    assert role_of(argv) == role


def test_an_unknown_process_is_unhealthy_with_its_command() -> None:
    with pytest.raises(Unhealthy, match="cannot tell which Shardyard process this is: sleep infinity"):
        role_of(["sleep", "infinity"])


def test_the_api_port_comes_from_its_flag() -> None:
    assert _port(["shardyard", "serve", "--port", "8123"]) == 8123
    assert _port(["shardyard", "serve"]) == 8000
