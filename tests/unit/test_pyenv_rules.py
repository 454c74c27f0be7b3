"""The requirement rules (jobrules/pyenv.py) that the API applies at submit and the worker again
before it installs: named requirements pass, options, URLs and paths are refused naming the line,
a pin that excludes a version the workers run is refused, and the environment's name does not
depend on how equivalent lines are written."""

from __future__ import annotations

import pytest

from jobrules.pyenv import (
    accepted,
    admits,
    parse_requirement,
    requirement_lines,
    requirement_problems,
    requirements_digest,
)

WORKER = {"torch": "2.13.0+cpu", "numpy": "1.26.4"}


@pytest.mark.parametrize(
    "line",
    [
        "einops==0.8.2",
        "timm>=1.0,<2",
        "Foo_Bar.baz[Extra1, extra2]~=1.4",
        'rich; python_version >= "3.8"',
        "torch",
    ],
)
def test_named_requirements_are_accepted(line: str) -> None:
    assert requirement_problems([("env.pip[0]", line)], installed=WORKER) == []


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("--index-url https://evil.example/simple", "pip option (--index-url)"),
        ("--extra-index-url=https://evil.example/simple", "pip option (--extra-index-url)"),
        ("-e .", "pip option (-e)"),
        ("-r other.txt", "pip option (-r)"),
        ("./mypkg", "URL or a local path"),
        ("/abs/pkg.whl", "URL or a local path"),
        ("pkg.tar.gz", "URL or a local path"),
        ("pkg @ https://example.com/pkg-1.0.whl", "URL or a local path"),
        ("git+https://github.com/x/y", "URL or a local path"),
        ("einops = 1", "not a requirement"),
    ],
)
def test_options_urls_and_paths_are_refused_naming_the_line(line: str, why: str) -> None:
    problems = requirement_problems([("requirements.txt line 3", line)], installed=WORKER)
    assert len(problems) == 1 and problems[0].startswith("requirements.txt line 3") and why in problems[0]
    if why != "not a requirement":  # an admin may allow them: passed to the installer as written
        assert requirement_problems([("x", line)], installed=WORKER, allow_options=True) == []


@pytest.mark.parametrize("line", ["torch==2.5.0", "torch<2", "numpy>=2", "numpy!=1.26.4", "torch~=2.12.0"])
def test_a_pin_that_replaces_the_workers_stack_is_refused(line: str) -> None:
    (problem,) = requirement_problems([("env.pip[1]", line)], installed=WORKER)
    assert problem.startswith("env.pip[1]") and "cannot be replaced" in problem
    assert WORKER[parse_requirement(line).name] in problem  # type: ignore[union-attr]


@pytest.mark.parametrize("line", ["torch==2.13.0", "torch==2.13.*", "torch>=2", "numpy<2", "torch~=2.13.0"])
def test_a_pin_the_worker_already_meets_is_accepted(line: str) -> None:
    assert requirement_problems([("env.pip[0]", line)], installed=WORKER) == []


def test_version_reading() -> None:
    assert admits("==", "2.0.*", "2.1.0") is False and admits("==", "2.*", "2.1.0") is True
    assert admits(">=", "1.10", "1.9") is False and admits("<", "1.10", "1.9") is True
    assert admits(">=", "2.0rc1", "2.1") is None  # a pre-release: the resolver decides


def test_requirements_file_lines_comments_and_continuations() -> None:
    text = "# mine\neinops==0.8.2  # for rearrange\n\ntimm>=1.0,\\\n  <2\n"
    assert requirement_lines(text) == [(2, "einops==0.8.2"), (4, "timm>=1.0,   <2")]


def test_the_environment_name_ignores_order_and_spelling_but_not_the_platform() -> None:
    a = accepted([("1", "Einops == 0.8.2"), ("2", "timm>=1.0")])
    b = accepted([("1", "timm >= 1.0"), ("2", "einops==0.8.2"), ("3", "einops==0.8.2")])
    assert len(b) == 2
    assert requirements_digest(a, platform="p") == requirements_digest(b, platform="p")
    assert requirements_digest(a, platform="p") != requirements_digest(a, platform="q")
    assert requirements_digest(a, platform="p") != requirements_digest(a[:1], platform="p")
