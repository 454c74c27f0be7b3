"""The dashboard's charts in a real browser on the real stack: the compare view, the log scale and
smoothing, readable axes on a diverged job, empty states, failed rows, a trial's job page, and the
confirm before a destructive button. Screenshots go to $SHARDYARD_SCREENSHOTS (default /tmp); the
ones in docs/ were taken by these tests."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from tests.browser.test_dashboard import spec

pytestmark = pytest.mark.browser

SHOTS = Path(os.environ.get("SHARDYARD_SCREENSHOTS", "/tmp"))

# the chart's drawn series, aligned on its steps, nulls (no point at that step) left out
DRAWN = """(sel) => {
    const u = document.querySelector(sel).uplot;
    return u.series.slice(1).map((s, i) => ({
        label: s.label,
        points: u.data[0].map((x, k) => [x, u.data[i + 1][k]]).filter(([, v]) => v !== null),
    }));
}"""


def stored(stack, job_id: int, name: str) -> dict[str, list[float]]:
    return stack.client.get(f"/api/jobs/{job_id}/metrics", params={"names": name}).json()["series"][name]


def ema(values: list[float], weight: float) -> list[float]:
    """Debiased EMA, written out here independently of the page's code."""
    out, acc = [], 0.0
    for n, v in enumerate(values, start=1):
        acc = acc * weight + (1 - weight) * v
        out.append(acc / (1 - weight**n))
    return out


@pytest.fixture(scope="module")
def two_jobs(stack) -> list[dict[str, Any]]:
    jobs = [stack.submit(spec(steps=30, seed=s, lr=lr)) for s, lr in ((11, 0.003), (12, 0.01))]
    return [stack.wait(j["id"]) for j in jobs]


def test_compare_view_draws_two_jobs_picked_in_the_table(stack, page: Page, two_jobs) -> None:
    page.goto(f"{stack.base_url}/#/")
    for j in two_jobs:
        page.locator(f'#jobs-table input[data-pick="{j["id"]}"]').check()
    button = page.locator("#compare-picked")
    expect(button).to_have_text("Compare 2/8")
    button.click()
    expect(page).to_have_url(re.compile(r"#/compare\?jobs="))
    chart = page.locator("#compare-chart")
    want = {j["id"]: stored(stack, j["id"], "loss") for j in two_jobs}
    expect(chart).to_have_attribute("data-points", str(sum(len(s["steps"]) for s in want.values())))
    drawn = page.evaluate(DRAWN, "#compare-chart")
    assert [d["label"] for d in drawn] == [f"#{j['id']} {j['name']}" for j in two_jobs]
    for d, j in zip(drawn, two_jobs, strict=True):
        assert [s for s, _ in d["points"]] == want[j["id"]]["steps"]
        assert [v for _, v in d["points"]] == pytest.approx(want[j["id"]]["values"])
    # the two lines differ (different lr), so the chart really holds two runs
    assert drawn[0]["points"] != drawn[1]["points"]
    expect(page.locator("#compare-chart .chart-empty")).to_be_hidden()
    page.screenshot(path=str(SHOTS / "dashboard-compare.png"), full_page=True)

    # a metric none of them has: the chart says so instead of staying blank
    page.locator("#compare-metric").select_option("tokens_per_s")
    expect(page).to_have_url(re.compile(r"metric=tokens_per_s"))
    page.goto(page.url.replace("tokens_per_s", "accuracy"))
    expect(page.locator("#compare-chart .chart-empty")).to_have_text(
        "None of these runs recorded accuracy yet."
    )
    page.goto(f"{stack.base_url}/#/compare")
    expect(page.locator("#compare-empty")).to_contain_text("tick up to 8 jobs")


def test_log_scale_and_smoothing_change_what_is_drawn(stack, page: Page, two_jobs) -> None:
    job = two_jobs[0]
    loss = stored(stack, job["id"], "loss")
    page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
    chart = page.locator("#loss-chart")
    expect(chart).to_have_attribute("data-points", re.compile(r"^[1-9]"))
    lo, hi = min(loss["values"]), max(loss["values"])
    mid = (lo * hi) ** 0.5  # the geometric middle sits mid-axis on a log scale only

    def frac(value: float) -> float:
        """Where `value` is drawn, 0 at the bottom of the y range and 1 at its top."""
        return page.evaluate(
            """(v) => {
                const u = document.querySelector('#loss-chart').uplot;
                const s = u.scales.y;
                return {distr: s.distr, at: 1 - u.valToPos(v, 'y') / u.valToPos(s.min, 'y')};
            }""",
            value,
        )

    linear = frac(mid)
    assert linear["distr"] == 1
    page.locator("#loss-chart input.chart-log").check()
    expect(chart).to_have_attribute("data-log", "1")
    logged = frac(mid)
    assert logged["distr"] == 3
    # loss falls faster than linearly early on: the log scale moves its geometric middle up
    assert logged["at"] != pytest.approx(linear["at"], abs=0.02)
    page.locator("#loss-chart input.chart-log").uncheck()

    raw = page.evaluate(DRAWN, "#loss-chart")[0]["points"]
    assert [v for _, v in raw] == pytest.approx(loss["values"])
    page.locator("#loss-chart input.chart-smooth").fill("0.8")
    expect(chart).to_have_attribute("data-smoothing", "0.8")
    smooth = page.evaluate(DRAWN, "#loss-chart")[0]["points"]
    assert [v for _, v in smooth] == pytest.approx(ema(loss["values"], 0.8))
    assert [v for _, v in smooth] != pytest.approx(loss["values"])
    # smoothing draws differently; the points held are still the stored ones
    expect(chart).to_have_attribute("data-points", re.compile(r"^[1-9]"))


def test_diverged_job_fails_with_its_error_in_the_row_and_readable_axes(stack, page: Page) -> None:
    bad = spec(steps=200, lr=10.0, optimizer="sgd")
    bad["name"] = "diverge"
    job = stack.submit(bad)
    failed = stack.wait(job["id"], ("failed",), timeout=180)
    assert "loss is" in failed["error"]
    loss = stored(stack, job["id"], "loss")
    # the case that clipped before: tick labels many digits long
    assert max(loss["values"]) > 1e5, loss["values"]

    page.goto(f"{stack.base_url}/#/")
    row = page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]')
    expect(row.locator(".row-error")).to_have_text(failed["error"].split("\n")[0])
    page.screenshot(path=str(SHOTS / "dashboard-jobs-failed.png"))

    page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
    expect(page.locator("#loss-chart")).to_have_attribute("data-points", re.compile(r"^[1-9]"))
    page.wait_for_timeout(300)  # the resize observer's redraw
    boxes = page.evaluate(
        """() => {
            const el = document.querySelector('#loss-chart');
            const u = el.uplot;
            const ax = u.axes[1];
            const dpr = devicePixelRatio;
            const over = u.over.getBoundingClientRect();
            const card = el.closest('.card').getBoundingClientRect();
            u.ctx.font = ax.font[0];
            // uPlot draws the y tick labels right-aligned at the plot's left edge less the
            // tick and the gap, and the axis title in the labelSize band left of the axis
            const right = over.left - ax.ticks.size - ax.gap;
            const labels = ax._values.map((t) => ({
                text: t, left: right - u.ctx.measureText(t).width / dpr, right,
            }));
            const titleRight = over.left - ax._size;
            return {labels, titleRight, titleLeft: titleRight - ax.labelSize,
                    card: {left: card.left, right: card.right}};
        }"""
    )
    assert boxes["labels"], boxes
    for lab in boxes["labels"]:
        assert lab["left"] >= boxes["card"]["left"], (lab, boxes["card"])
        assert lab["left"] >= boxes["titleRight"] - 0.5, (lab, boxes["titleRight"])
        assert len(lab["text"]) <= 6, lab
    assert boxes["titleLeft"] >= boxes["card"]["left"], boxes
    page.screenshot(path=str(SHOTS / "dashboard-diverged.png"), full_page=True)


def test_trial_page_links_its_batch_and_says_stopped_early(stack, page: Page) -> None:
    body = {
        "name": "charts-asha",
        "base": spec(steps=8, eval_every=2),
        "space": {"train.lr": [1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]},
        "method": "grid",
        "devices": 2,
        "seed": 1,
        "early_stopping": {"kind": "asha", "reduction_factor": 2, "min_steps": 2},
    }
    sid = stack.submit_selection(body)["id"]
    done = stack.wait_selection(sid)
    stopped = [t for t in done["trials"] if t["status"] == "stopped_early"]
    assert stopped, done["trials"]
    t = stopped[0]
    rung = t["stop_reason"]["rung"] if t.get("stop_reason") else None
    rung = rung or stack.client.get(f"/api/jobs/{t['job_id']}").json()["result"]["stop_reason"]["rung"]

    page.goto(f"{stack.base_url}/#/jobs/{t['job_id']}")
    expect(page.locator("#job-stopped-early")).to_contain_text(f"stopped early at rung {rung} ")
    expect(page.locator("#job-header .badge")).to_have_text("stopped early")
    page.screenshot(path=str(SHOTS / "dashboard-trial.png"))
    link = page.locator("#job-selection")
    expect(link).to_have_attribute("href", f"#/selections/{sid}")
    link.click()
    expect(page.locator("#selection-header h1")).to_contain_text("charts-asha")

    # one colour per trial: its curve and its parallel-coordinates line agree
    expect(page.locator("#parcoords polyline.trial-line")).to_have_count(len(done["trials"]))
    colours = page.evaluate(
        """() => {
            const u = document.querySelector('#curves-chart').uplot;
            // uPlot keeps a series' stroke as a function of (plot, series index) once built
            const stroke = (s, i) => (typeof s.stroke === 'function' ? s.stroke(u, i) : s.stroke);
            const curve = Object.fromEntries(u.series.map((s, i) => [s.label, stroke(s, i)]));
            return [...document.querySelectorAll('#parcoords polyline.trial-line')].map((l) => [
                curve['trial ' + l.dataset.index], l.getAttribute('stroke')]);
        }"""
    )
    assert colours and all(a == b for a, b in colours), colours
    # the plot fills its card (measured in one go: a redraw replaces the svg)
    card, plot = page.evaluate(
        """() => [document.querySelector('#parcoords').getBoundingClientRect().width,
                  document.querySelector('#parcoords svg').getBoundingClientRect().width]"""
    )
    assert card > 900 and plot >= 0.95 * card, (card, plot)

    # pick two trials from the leaderboard and compare them
    rows = page.locator("#leaderboard tbody tr")
    expect(rows).to_have_count(len(done["trials"]))
    picks = [done["trials"][0], done["trials"][1]]
    for tr in picks:
        page.locator(f'#leaderboard input[data-pick="{tr["id"]}"]').check()
    page.screenshot(path=str(SHOTS / "dashboard-selection.png"), full_page=True)
    page.locator("#compare-trials").click()
    chart = page.locator("#compare-chart")
    want = [stored(stack, tr["job_id"], "val_loss") for tr in picks]
    expect(chart).to_have_attribute("data-points", str(sum(len(s["steps"]) for s in want)))
    drawn = page.evaluate(DRAWN, "#compare-chart")
    assert [d["label"] for d in drawn] == [f"trial {tr['index']} (#{tr['job_id']})" for tr in picks]
    for d, s in zip(drawn, want, strict=True):
        assert [x for x, _ in d["points"]] == s["steps"]


def test_cancel_asks_before_it_cancels(stack, page: Page) -> None:
    job = stack.submit(spec(steps=1_000_000))
    stack.wait(job["id"], ("running",), timeout=120)
    try:
        asked: list[str] = []

        def answer(accept: bool):  # noqa: ANN202
            def handle(dialog) -> None:  # noqa: ANN001
                asked.append(dialog.message)
                dialog.accept() if accept else dialog.dismiss()

            return handle

        # a running job on the compare view draws on as it reports
        page.goto(f"{stack.base_url}/#/compare?jobs={job['id']}")
        chart = page.locator("#compare-chart")
        expect(chart).to_have_attribute("data-points", re.compile(r"^[1-9]"), timeout=30_000)
        first = int(chart.get_attribute("data-points") or 0)
        page.wait_for_function(
            "(n) => +document.querySelector('#compare-chart').dataset.points > n", arg=first, timeout=60_000
        )

        page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
        page.once("dialog", answer(False))
        page.locator("#job-header button.danger").click()
        expect(page.locator("#job-header .badge")).to_have_text("running")
        assert asked and f"#{job['id']}" in asked[-1]
        page.wait_for_timeout(1000)
        assert not stack.job(job["id"])["cancel_requested"], "dismissing the confirm cancelled the job"

        page.goto(f"{stack.base_url}/#/")
        row = page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]')
        page.once("dialog", answer(True))
        row.locator("button[data-cancel]").click()
        expect(row).to_have_attribute("data-status", "cancelled", timeout=60_000)
        assert len(asked) == 2 and f"#{job['id']}" in asked[-1]
    finally:
        stack.client.post(f"/api/jobs/{job['id']}/cancel")
