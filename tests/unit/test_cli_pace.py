"""The CLI's pace line (`shardyard follow`): steps/s and ETA from the steps seen, and its clock."""

from __future__ import annotations

import pytest

from api.cli import clock, pace


def test_pace_is_the_rate_since_the_first_step_seen_and_the_eta_what_is_left_at_it() -> None:
    rate, left = pace(step0=10, t0=100.0, step=30, now=110.0, steps=100)
    assert rate == pytest.approx(2.0) and left == pytest.approx(35.0)


def test_no_pace_until_the_steps_moved() -> None:
    assert pace(step0=5, t0=1.0, step=5, now=9.0, steps=10) == (None, None)


def test_clock() -> None:
    assert [clock(None), clock(75), clock(3725.4)] == ["-", "1:15", "1:02:05"]
