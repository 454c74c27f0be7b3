"""The selection page says why each trial ended (a rung stop: its rung, its value, the rung's
cut-off) and shows each trial's compute and copy seconds, in a real browser on the real stack."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from tests.browser.test_dashboard import spec

pytestmark = pytest.mark.browser


def test_selection_page_shows_stop_reasons_and_per_trial_results(stack, page: Page) -> None:
    body = {
        "name": "browser-asha",
        "base": spec(steps=8, eval_every=4),
        "space": {"train.lr": [1e-4, 1e-3, 1e-2, 3e-2]},
        "method": "grid",
        "devices": 2,
        "seed": 1,
        "early_stopping": {"kind": "sha", "reduction_factor": 2, "min_steps": 2},
    }
    sid = stack.submit_selection(body)["id"]
    page.goto(f"{stack.base_url}/#/selections/{sid}")
    expect(page.locator("#selection-header .badge")).to_have_text("succeeded", timeout=240_000)
    expect(page.locator("#selection-header")).to_contain_text("sha, reduction factor 2, first rung at step 2")
    done = stack.wait_selection(sid)
    stopped = [t for t in done["trials"] if t["status"] == "stopped_early"]
    assert stopped  # SHA keeps max(1, 4 // 2) = 2 at rung 2, and 1 at rung 4
    for t in done["trials"]:
        result = stack.client.get(f"/api/jobs/{t['job_id']}").json()["result"]
        row = page.locator(f'#leaderboard tbody tr[data-trial-id="{t["id"]}"]')
        why = row.locator('td[data-col="why"]')
        if t["status"] == "stopped_early":
            s = result["stop_reason"]
            expect(why).to_contain_text(f"rung {s['rung']}: ")
            expect(why).to_contain_text(f"(kept {s['kept']} of {s['of']})")
            expect(why).to_contain_text(re.compile(r"≥ cut-off \d"))
        else:
            expect(why).to_have_text(f"trained to step {t['steps_done']}")
        expect(row.locator('td[data-col="compute"]')).to_have_text(re.compile(r"^\d"))
        expect(row.locator('td[data-col="copy"]')).to_have_text(re.compile(r"^\d"))
        assert result["compute_s"] > 0
    page.screenshot(path="/tmp/dashboard-selection-stops.png", full_page=True)
