"""The worker's relay stores a job's own metric names by the trainer's rules (jobrules/user_metrics.py)
even when the lines did not come from the trainer's checks (the job's code wrote them on the
protocol channel itself): a name too long for its column or of other characters is dropped, and a
job stores at most 64 names of its own; the trainer's and the worker's names always pass."""

from __future__ import annotations

from db import ingest as dbi
from db.connection import session_for
from db.models import Trial
from jobrules.user_metrics import MAX_NAMES
from tests.unit.test_relay_order import _batch, _feed, _line, _relay


def test_forged_metric_names_are_dropped_and_capped(db_url: str) -> None:
    _, won = _batch(db_url, 1)
    relay = _relay(db_url, won)
    lines = [
        _line(0, 0, "metric", step=1, name="loss", value=2.0),
        _line(1, 0, "metric", step=1, name="hw.cpu_pct.r0", value=90.0),
        _line(2, 0, "metric", step=1, name="accuracy", value=0.5),
        _line(3, 0, "metric", step=1, name="x" * 100, value=1.0),
        _line(4, 0, "metric", step=1, name="a b", value=1.0),
    ]
    lines += [_line(5 + i, 0, "metric", step=1, name=f"m{i}", value=float(i)) for i in range(MAX_NAMES + 6)]
    lines.append(_line(100, 0, "metric", step=2, name="accuracy", value=0.75))  # a known name goes on
    _feed(relay, *lines)
    relay.flush()
    assert relay.close()
    with session_for(db_url) as s:
        job_id = s.get(Trial, won[0][0].id).job_id
        got = dbi.metric_series(s, job_id=job_id)
    mine = {n for n in got if n not in ("loss", "hw.cpu_pct.r0")}
    assert len(mine) == MAX_NAMES and {"accuracy", "m0", f"m{MAX_NAMES - 2}"} <= mine
    assert f"m{MAX_NAMES - 1}" not in mine and "a b" not in mine and "x" * 100 not in mine
    assert got["accuracy"] == ([1, 2], [0.5, 0.75])
    assert "loss" in got and "hw.cpu_pct.r0" in got
