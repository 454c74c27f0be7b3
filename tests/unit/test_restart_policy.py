"""The embedded stack's restart policy (api/stack.py): the back-off doubles with each recent death
up to its cap, bad numbers are refused with the numbers in the message, and an exit reads as the
signal that ended the process. The restarts themselves: tests/integration/test_stack_supervisor.py."""

from __future__ import annotations

import pytest

from api.stack import RestartPolicy, describe_exit


def test_the_back_off_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.delay_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"backoff_s": 0.0}, "backoff_s (0.0)"),
        ({"backoff_s": 60.0, "max_backoff_s": 30.0}, "max_backoff_s (30.0)"),
        ({"max_restarts": 0}, "max_restarts (0)"),
        ({"window_s": -1.0}, "window_s (-1.0)"),
    ],
)
def test_bad_numbers_are_refused(kwargs: dict[str, float], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        RestartPolicy(**kwargs)


def test_an_exit_names_its_signal() -> None:
    assert describe_exit(-9) == "-9 (SIGKILL)"
    assert describe_exit(-15) == "-15 (SIGTERM)"
    assert describe_exit(2) == "2"
    assert describe_exit(-200) == "-200"
