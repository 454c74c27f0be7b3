"""A batch of 1,000 trials in a real browser: the leaderboard lists the first 100 in its order
until asked for all, while the parallel coordinates and the curves chart hold every trial (their
curves from one request, GET /api/selections/{id}/curves)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect

from api.stack import Stack
from bench.scale_seed import Sizes, _PointWriter, _seed_selection, _trial_points
from db.connection import session_for
from db.users import create_user
from tests.browser.conftest import tab
from tests.conftest import StackHandle, running

pytestmark = pytest.mark.browser
TRIALS = 1000


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StackHandle, int]]:
    # no scheduler: the seeded batch's queued trials stay as they are
    st = Stack(
        root=tmp_path_factory.mktemp("big-batch"),
        workers=0,
        extra_env={"SHARDYARD_EMBEDDED_SCHEDULER": "false"},
    )
    with running(st) as handle:
        url = st.database_url
        with session_for(url) as s:
            owner = create_user(s, name="sweeper").id
        sizes = Sizes(
            jobs=100,
            points=55_000,
            big_job_points=0,
            trials=TRIALS,
            trial_steps=50,
            queued=1,
            fleet_fill=1,
            running=1,
        )
        sid, job_ids = _seed_selection(url, sizes=sizes, owner=owner, rng=random.Random(0))
        writer = _PointWriter(url)
        for k, job_id in enumerate(job_ids):
            writer.add(_trial_points(job_id, sizes.trial_steps, 0.0, 1 + (k % 50) / 50))
        writer.close()
        yield handle, sid


def test_a_thousand_trial_batch_lists_100_until_asked_and_draws_every_trial(
    browser: Browser, batch: tuple[StackHandle, int]
) -> None:
    handle, sid = batch
    requests: list[str] = []
    with tab(browser, token=handle.token, base_url=handle.base_url) as page:
        page.on("request", lambda r: requests.append(r.url))
        page.goto(f"{handle.base_url}/#/selections/{sid}")
        expect(page.locator("#curves-chart[data-curves-loaded]")).to_have_count(1, timeout=60_000)
        rows = page.locator("#leaderboard tbody tr")
        expect(rows).to_have_count(100)
        expect(page.locator("#parcoords svg polyline")).to_have_count(TRIALS)
        # one request for every trial's curve, none per trial
        assert sum("/curves" in u for u in requests) == 1
        assert not [u for u in requests if "/metrics" in u]
        ranks = [int(t) for t in rows.locator("td[data-col='rank']").all_inner_texts()]
        assert ranks == list(range(1, 101))  # the best 100, in rank order
        page.locator("#leaderboard-all").click()
        expect(rows).to_have_count(TRIALS)
        page.locator("#leaderboard-all").click()
        expect(rows).to_have_count(100)
        # every trial's curve is in the chart
        held = int(page.locator("#curves-chart").get_attribute("data-points") or 0)
        assert held == TRIALS * 5  # val_loss every 10th of 50 steps
