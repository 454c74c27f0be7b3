"""The CLI's pace line (`shardyard follow`): steps/s and ETA from the steps seen, and its clock."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from shardyard.cli import FollowView, clock, pace
from shardyard.results import StatusEvent


def test_pace_is_the_rate_since_the_first_step_seen_and_the_eta_what_is_left_at_it() -> None:
    rate, left = pace(step0=10, t0=100.0, step=30, now=110.0, steps=100)
    assert rate == pytest.approx(2.0) and left == pytest.approx(35.0)


def test_no_pace_until_the_steps_moved() -> None:
    assert pace(step0=5, t0=1.0, step=5, now=9.0, steps=10) == (None, None)


def test_clock() -> None:
    assert [clock(None), clock(75), clock(3725.4)] == ["-", "1:15", "1:02:05"]


def test_attaching_to_a_running_job_shows_it_running_at_its_own_pace_and_age() -> None:
    """`shardyard follow` on a job at step 52: the stream replays its 52 points in a burst, then its
    old `queued` and `running`. It used to read `queued`, 20,560 steps/s and elapsed 0:00."""
    t0 = 1_800_000_000.0  # the job was queued at t0 and started 0.4 s later
    job = SimpleNamespace(
        status="running",
        started_at=datetime.fromtimestamp(t0 + 0.4, UTC),
        run_seconds=26.3,
        progress=SimpleNamespace(step=52, steps=600),
    )
    view = FollowView.attach(job, now=1000.0)
    for step in range(1, 53):  # two steps a second, by the job's clock
        view.on_loss(step, t0 + 0.4 + step / 2)
    assert not view.on_status(StatusEvent(status="queued", job_id=1, time=t0), now=1000.05)
    assert not view.on_status(StatusEvent(status="running", job_id=1, time=t0 + 0.5), now=1000.06)
    assert view.status == "running"
    rate, left = view.pace()
    assert rate == pytest.approx(2.0) and left == pytest.approx((600 - 52) / 2)
    assert view.elapsed(1000.1) == pytest.approx(26.4)
    # live: preempted back to the queue (news, and the clock stands), then running again
    assert view.on_status(StatusEvent(status="queued", job_id=1, time=t0 + 40), now=1010.0)
    assert view.status == "queued" and view.elapsed(1050.0) == pytest.approx(36.3)
    assert not view.on_status(StatusEvent(status="running", job_id=1, time=t0 + 90), now=1050.0)
    assert view.elapsed(1060.0) == pytest.approx(46.3)
    assert view.pace() == (None, None)  # the new attempt's pace is its own
    view.on_loss(40, t0 + 100)  # resumed from the checkpoint at step 39
    view.on_loss(50, t0 + 105)
    assert view.pace()[0] == pytest.approx(2.0)


def test_a_queued_job_starts_its_clock_when_it_starts() -> None:
    job = SimpleNamespace(
        status="queued", started_at=None, run_seconds=0.0, progress=SimpleNamespace(step=0, steps=10)
    )
    view = FollowView.attach(job, now=5.0)
    assert view.elapsed(100.0) == 0.0
    assert not view.on_status(StatusEvent(status="queued", job_id=1, time=1.0), now=6.0)
    view.on_status(StatusEvent(status="running", job_id=1, time=2.0), now=10.0)
    assert view.status == "running" and view.elapsed(13.0) == pytest.approx(3.0)
    view.on_status(StatusEvent(status="succeeded", job_id=1, time=3.0), now=20.0)
    assert view.elapsed(99.0) == pytest.approx(10.0)
