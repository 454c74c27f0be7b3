"""The dashboard in a real browser (Debian's Chromium driven by Playwright) against the real stack:
redis-server, a Celery worker training real tiny models, and the API serving frontend/dist.

Needs `frontend/dist` built (`cd frontend && npm ci && npm run build`) and /usr/bin/chromium
(Debian's `chromium` package; Playwright's own browser download is never used).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.user_data import held_data, upload_held

pytestmark = pytest.mark.browser

SCREENSHOT = Path("/tmp/dashboard.png")

# small enough to train in seconds on a shared 2-core machine, long enough to see several points
TINY_SPEC: dict[str, Any] = {
    "name": "browser-tiny",
    "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 4, "seq_len": 16},
    "data": {"kind": "text", "corpus": "stdlib", "max_chars": 200_000},
    "train": {"steps": 40, "batch_size": 8, "lr": 0.003, "seed": 0, "eval_every": 10, "eval_batches": 2},
    "resources": {"device": "cpu"},
}


def spec(**train: Any) -> dict[str, Any]:
    s = json.loads(json.dumps(TINY_SPEC))
    s["train"].update(train)
    return s


def test_dashboard_is_served_with_health_bar(stack, page: Page) -> None:
    page.goto(f"{stack.base_url}/")
    expect(page.locator("#jobs-table")).to_be_visible()
    # the header bar shows /api/health: db and broker up, the fixture's worker seen
    health = page.locator("#health")
    expect(health).to_have_attribute("data-status", "ok", timeout=20_000)
    expect(health).to_contain_text("db")
    expect(health).to_contain_text("broker")
    expect(health).to_contain_text("worker")


def test_jobs_table_updates_live(stack, page: Page) -> None:
    page.goto(f"{stack.base_url}/#/")
    # the global SSE stream is connected (not the polling fallback)
    expect(page.locator("#live-state")).to_have_text("live", timeout=15_000)
    page.evaluate("window.__noReload = true")

    job = stack.submit(spec(seed=1))
    row = page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]')
    expect(row).to_be_visible(timeout=15_000)
    expect(row).to_contain_text("browser-tiny")
    expect(row).to_have_attribute("data-status", "succeeded", timeout=120_000)
    expect(row.locator(".badge")).to_have_text("succeeded")
    # the final loss from the job's result fills the loss column
    final = stack.wait(job["id"])
    assert final["result"]["final_loss"] > 0
    expect(row.locator("td").nth(5)).not_to_have_text("—")
    # the same document all along: the change arrived without a reload
    assert page.evaluate("window.__noReload") is True


def test_job_page_draws_charts_and_logs(stack, page: Page) -> None:
    job = stack.submit(spec(seed=2))
    page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
    expect(page.locator("#job-header h1")).to_contain_text(f"Job #{job['id']}")
    expect(page.locator("#job-header .badge")).to_have_text("succeeded", timeout=120_000)
    stack.wait(job["id"])

    metrics = stack.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss,val_loss"}).json()
    loss = metrics["series"]["loss"]
    val = metrics["series"]["val_loss"]
    assert len(loss["steps"]) == TINY_SPEC["train"]["steps"]

    # the uPlot instance holds every stored loss point (backfill + stream, deduplicated by step)
    chart = page.locator("#loss-chart")
    expect(chart).to_have_attribute(
        "data-points", str(len(loss["steps"]) + len(val["steps"])), timeout=10_000
    )
    drawn = page.evaluate(
        """() => {
            const u = document.querySelector('#loss-chart').uplot;
            const pick = (i) => u.data[0].map((s, k) => [s, u.data[i][k]]).filter(([, v]) => v !== null);
            return {loss: pick(1), val: pick(2), width: u.width, canvas: !!u.root.querySelector('canvas')};
        }"""
    )
    assert drawn["canvas"] and drawn["width"] > 100
    assert [s for s, _ in drawn["loss"]] == loss["steps"]
    assert [v for _, v in drawn["loss"]] == pytest.approx(loss["values"])
    assert [s for s, _ in drawn["val"]] == val["steps"]
    # throughput chart got its points too
    assert int(page.locator("#tput-chart").get_attribute("data-points") or 0) > 0

    # log lines: what /logs holds is in the panel, including the final status change
    logs = stack.client.get(f"/api/jobs/{job['id']}/logs").json()["items"]
    assert logs, "the job recorded no log lines"
    panel = page.locator("#log-panel li")
    expect(panel.first).to_be_visible()
    assert panel.count() >= len(logs)
    expect(page.locator("#log-panel")).to_contain_text("succeeded")
    expect(page.locator("#job-result")).to_contain_text("final_loss")

    page.screenshot(path=str(SCREENSHOT), full_page=True)


def test_job_page_charts_fill_live(stack, page: Page, gate: Path) -> None:
    """Opened before the job runs: points reach the chart over EventSource while it is running."""
    # the job waits at its 5th batch until the page watches its chart (the gate goes), then takes
    # ~0.1 s a step (tests/user_data.py): it runs on for seconds after the page's load however
    # slow that load is. The stdlib spec's 100 steps once finished before the page had drawn (CI:
    # one draw, at "succeeded"), and a run made long enough can still lose to a slow page
    live = {**spec(steps=100, eval_every=25), **held_data(upload_held(stack), gate, hold_at=5, pause=0.1)}
    job = stack.submit(live)
    page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
    # the page draws once the session is confirmed (GET /api/auth/me)
    expect(page.locator("#loss-chart")).to_be_attached(timeout=15_000)
    # note the job's status each time the chart redraws with new points
    page.evaluate(
        """() => {
            window.__seen = [];
            const chart = document.querySelector('#loss-chart');
            new MutationObserver(() => window.__seen.push([
                +chart.dataset.points,
                document.querySelector('#job-header .badge')?.textContent,
            ])).observe(chart, {attributes: true, attributeFilter: ['data-points']});
        }"""
    )
    gate.unlink()
    expect(page.locator("#job-header .badge")).to_have_text("succeeded", timeout=120_000)
    seen = page.evaluate("window.__seen")
    assert any(n > 0 and status == "running" for n, status in seen), seen
    stored = stack.client.get(f"/api/jobs/{job['id']}/metrics", params={"names": "loss,val_loss"}).json()
    n = sum(len(s["steps"]) for s in stored["series"].values())
    assert n == 100 + 4  # a loss per step, a val_loss every 25
    expect(page.locator("#loss-chart")).to_have_attribute("data-points", str(n), timeout=10_000)


def test_submit_form_names_the_bad_field_and_cancel_button(stack, page: Page) -> None:
    page.goto(f"{stack.base_url}/#/")
    before = stack.client.get("/api/jobs").json()["total"]
    box = page.locator("#spec-input")
    # the form comes pre-filled with a valid spec
    assert json.loads(box.input_value())["model"]["kind"] == "gpt"

    bad = spec()
    bad["model"]["layers"] = 0
    box.fill(json.dumps(bad))
    page.get_by_role("button", name="Submit job").click()
    result = page.locator("#submit-result")
    expect(result).to_have_class("error")
    expect(result).to_contain_text("model.layers")

    bad = spec()
    bad["model"]["heads"] = 5  # 32 is not divisible by 5
    box.fill(json.dumps(bad))
    page.get_by_role("button", name="Submit job").click()
    expect(result).to_contain_text("model.heads")
    assert stack.client.get("/api/jobs").json()["total"] == before

    # a good spec goes through; a long job is then cancelled from its row
    box.fill(json.dumps(spec(steps=100_000)))
    page.get_by_role("button", name="Submit job").click()
    expect(result).to_have_class("ok")
    job_id = int(result.locator("a").inner_text().removeprefix("job #"))
    row = page.locator(f'#jobs-table tr[data-job-id="{job_id}"]')
    page.once("dialog", lambda d: d.accept())  # Cancel asks first
    row.locator("button[data-cancel]").click()
    expect(row).to_have_attribute("data-status", "cancelled", timeout=60_000)
    assert stack.wait(job_id, statuses=("cancelled",), timeout=60)["status"] == "cancelled"


def test_selection_page_leaderboard_curves_parcoords_and_growth(stack, page: Page) -> None:
    body = {
        "name": "browser-lr",
        "base": spec(steps=24, eval_every=4),
        "space": {"train.lr": [1e-3, 3e-3, 1e-2]},
        "method": "grid",
        "devices": 2,
    }
    sid = stack.submit_selection(body)["id"]
    page.goto(f"{stack.base_url}/#/selections/{sid}")
    expect(page.locator("#selection-header h1")).to_contain_text("browser-lr")
    expect(page.locator("#selection-header .badge")).to_have_text("succeeded", timeout=240_000)
    done = stack.wait_selection(sid)
    trials = {t["id"]: t for t in done["trials"]}

    # leaderboard: one row per trial, best first, ranked as the server ranks them
    rows = page.locator("#leaderboard tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.first).to_have_attribute("data-trial-id", str(done["leaderboard"][0]))
    # sortable: best val_loss ascending, then descending
    header = page.locator('#leaderboard th[data-sort="best"]')
    header.click()
    ids = [int(i) for i in rows.evaluate_all("rs => rs.map(r => r.dataset.trialId)")]
    best = [trials[i]["best_metric"] for i in ids]
    assert best == sorted(best)
    header.click()
    ids = [int(i) for i in rows.evaluate_all("rs => rs.map(r => r.dataset.trialId)")]
    assert [trials[i]["best_metric"] for i in ids] == sorted(best, reverse=True)

    # the curves chart holds every trial's stored val_loss series, one line per trial
    want = {
        tid: stack.client.get(f"/api/jobs/{t['job_id']}/metrics", params={"names": "val_loss"}).json()[
            "series"
        ]["val_loss"]["steps"]
        for tid, t in trials.items()
    }
    assert all(len(s) == 24 // 4 for s in want.values())
    expect(page.locator("#curves-chart")).to_have_attribute(
        "data-points", str(sum(len(s) for s in want.values())), timeout=10_000
    )
    labels = page.evaluate(
        "() => document.querySelector('#curves-chart').uplot.series.slice(1).map(s => s.label)"
    )
    assert sorted(labels) == sorted(f"trial {t['index']}" for t in trials.values())

    # parallel coordinates: an axis per hyperparameter plus the metric, a line per trial
    pc = page.locator("#parcoords svg")
    expect(pc.locator(".pc-label")).to_have_text(["train.lr", "best val_loss"])
    expect(pc.locator("polyline.trial-line")).to_have_count(3)

    # grow the finished batch from the page with a long trial, then stop that trial from its row
    page.locator("#add-trials-input").fill(json.dumps([{"train.lr": 2e-3, "train.steps": 100_000}]))
    page.get_by_role("button", name="Add trials").click()
    expect(page.locator("#selection-result")).to_have_class("ok", timeout=15_000)
    expect(rows).to_have_count(4, timeout=15_000)
    added = [t for t in stack.client.get(f"/api/selections/{sid}").json()["trials"] if t["id"] not in trials]
    assert len(added) == 1
    new_id = added[0]["id"]
    new = page.locator(f'#leaderboard tbody tr[data-trial-id="{new_id}"]')
    page.once("dialog", lambda d: d.accept())  # Stop asks first
    new.locator("button[data-stop]").click()
    expect(new).to_have_attribute("data-status", re.compile("stopped|cancelled"), timeout=120_000)
    final = stack.wait_selection(sid)
    grown = [t for t in final["trials"] if t["id"] not in trials]
    assert len(grown) == 1 and grown[0]["status"] in ("stopped", "cancelled")
    assert grown[0]["steps_done"] < 100_000
    page.screenshot(path="/tmp/dashboard-selection.png", full_page=True)


def test_pipeline_job_shows_executed_and_simulated_gantt(stack, page: Page) -> None:
    pipe = spec(steps=4, eval_every=2)
    pipe["parallel"] = {"pipeline": {"stages": 2, "microbatches": 4, "schedule": "chimera"}}
    job = stack.submit(pipe)
    page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
    expect(page.locator("#pipeline h2")).to_contain_text("chimera, 2 stages × 4 micro-batches")
    stack.wait(job["id"], timeout=240)
    timeline = stack.client.get(f"/api/jobs/{job['id']}/timeline").json()

    # the page fetched the timeline when the job finished: one bar per action, per panel
    for panel, actions in (("executed", timeline["executed"]), ("simulated", timeline["simulated"])):
        svg = page.locator(f"#gantt-{panel} svg.gantt")
        expect(svg).to_have_attribute("data-actions", str(len(actions)), timeout=30_000)
        bars = svg.locator("g.bar")
        expect(bars).to_have_count(len(actions))
        drawn = bars.evaluate_all("gs => gs.map(g => [+g.dataset.rank, g.dataset.op])")
        assert sorted(map(tuple, drawn)) == sorted((a["rank"], a["op"]) for a in actions)
        # a row per rank, the micro-batch numbers written on the bars
        expect(svg.locator("text.rank")).to_have_text(["rank 0", "rank 1"])
        mbs = {int(t) for t in svg.locator("text.mb").all_text_contents()}
        assert mbs and mbs <= {a["mb"] for a in actions if a["mb"] is not None and a["mb"] >= 0}
    page.screenshot(path="/tmp/dashboard-pipeline.png", full_page=True)


def test_queued_job_shows_its_place_and_why_it_waits(stack, page: Page) -> None:
    """A user at their quota of one running job: the second job waits queued, and both the jobs
    table and the job page show its place in the scheduler's queue and the reason."""
    made = stack.client.post("/api/users", json={"name": f"b{time.time_ns()}", "max_running_jobs": 1})
    assert made.status_code == 201, made.text
    auth = {"Authorization": f"Bearer {made.json()['token']}"}
    with httpx.Client(base_url=stack.base_url, headers=auth, timeout=30) as c:
        first = c.post("/api/jobs", json=spec(steps=1_000_000)).json()["id"]
        second = c.post("/api/jobs", json=spec(steps=3)).json()["id"]
    try:
        stack.wait(first, ("running",), timeout=180)
        stack.wait_until(second, lambda j: j["queue_position"] and "quota" in (j["wait_reason"] or ""))
        page.goto(f"{stack.base_url}/#/jobs/{second}")
        expect(page.locator("#job-wait-reason")).to_contain_text("the quota is 1")
        expect(page.locator("#job-queue-position")).to_have_text(re.compile(r"^#\d+$"))
        page.goto(f"{stack.base_url}/")
        row = page.locator(f'tr[data-job-id="{second}"]')
        expect(row.locator(".queue-position")).to_contain_text("in queue")
        expect(row.locator(".wait-reason")).to_contain_text("quota")
        page.goto(f"{stack.base_url}/#/jobs/{first}")
        expect(page.locator("#job-reservation")).to_contain_text("node 0/1")
    finally:
        for job_id in (first, second):
            stack.client.post(f"/api/jobs/{job_id}/cancel")
        for job_id in (first, second):
            stack.wait(job_id, ("cancelled", "succeeded"), timeout=120)
