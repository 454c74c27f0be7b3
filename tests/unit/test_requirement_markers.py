"""A requirement's environment marker is parsed whole by the PEP 508 grammar when the line is
checked (at submit, at a workspace's upload, and on the worker before it installs): a marker that
is code, not a comparison, is refused naming the line and the rule."""

from __future__ import annotations

import pytest

from jobrules.pyenv import MARKER_RULE, parse_requirement, requirement_problems
from jobrules.spec import JobSpec, SpecError, parse_job

EVIL = [
    "einops; __import__('os').system('id')",
    "einops; os.system('id')",
    'einops; python_version >= "3.10" and exec("1")',
    "einops; python_version >= 3.10",  # an unquoted version is not a marker either
    "einops==0.8.2 ; (python_version)",
]


@pytest.mark.parametrize("line", EVIL)
def test_markers_that_are_not_pep_508_are_refused_naming_the_line(line: str) -> None:
    problems = requirement_problems([("env.pip[0]", line)])
    assert len(problems) == 1, problems
    assert problems[0].startswith("env.pip[0]") and "environment marker that is not PEP 508" in problems[0]
    assert MARKER_RULE in problems[0]
    # an admin's leave to use pip options and direct references does not let a marker through
    assert isinstance(parse_requirement(line, allow_options=True), str)
    assert isinstance(
        parse_requirement(f"einops @ https://example.org/e.whl ; {line.split(';')[1]}", allow_options=True),
        str,
    )


def test_pep_508_markers_are_accepted_as_before() -> None:
    for line in (
        'timm[hub]>=1.0; python_version >= "3.10"',
        "einops==0.8.2; sys_platform == 'linux' and platform_machine != \"arm64\"",
        'einops; extra == "x"',
    ):
        got = parse_requirement(line)
        assert not isinstance(got, str), (line, got)
    assert parse_requirement('Timm[Hub] >= 1.0 ;  python_version >= "3.10"').text == (
        'timm[hub]>=1.0; python_version >= "3.10"'
    )


def test_a_job_spec_with_a_bad_marker_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError) as e:
        parse_job({"env": {"pip": ["einops==0.8.2", EVIL[0]]}})
    assert "env: Value error" not in str(e.value)
    assert "env.pip[1]" in str(e.value) and "not PEP 508" in str(e.value)
    JobSpec.model_validate({"env": {"pip": ['einops==0.8.2; python_version >= "3.10"']}})
