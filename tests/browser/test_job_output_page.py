"""What a user sees of a job's own output, pace and hardware, in Debian's Chromium against the real
stack (redis-server, a Celery worker training real tiny models): a failed job's traceback on its
page, a line the trainer printed reaching the Log panel while the job runs, the pace and the
hardware charts filling, and a running selection trial's steps moving before it ends. The
screenshots go to docs/ (docs/dashboard.md shows them)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.integration.test_job_output import CHATTY_PY, chatty_spec, upload_chatty

pytestmark = pytest.mark.browser

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_a_failed_jobs_page_shows_its_traceback(stack, page: Page) -> None:
    ws = upload_chatty(stack)
    job = stack.submit(chatty_spec(ws, name="dry", steps=20, fail_at=6))
    stack.wait(job["id"], ("failed",), timeout=180)
    page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
    tb = page.locator("#job-traceback")
    expect(tb).to_contain_text("Traceback (most recent call last):", timeout=15_000)
    expect(tb).to_contain_text("RuntimeError: the user's data ran dry")
    line = (
        CHATTY_PY.decode()
        .splitlines()
        .index('                raise RuntimeError("the user\'s data ran dry")')
        + 1
    )
    expect(tb).to_contain_text(f'chatty/source.py", line {line}, in stream')
    # the log panel's search narrows it to the lines that match, and says how many
    page.fill("#log-search", "ran dry")
    visible = page.locator("#log-panel li:visible")
    expect(visible.first).to_contain_text("ran dry")
    assert all("ran dry" in t for t in visible.all_inner_texts())
    expect(page.locator("#log-count")).to_contain_text(" of ")
    page.fill("#log-search", "")
    page.screenshot(path=str(DOCS / "job-failed.png"), full_page=True)


def test_a_running_jobs_page_gets_the_trainers_print_its_pace_and_hardware(stack, page: Page) -> None:
    ws = upload_chatty(stack)
    # ~0.3 s a step: it runs long enough to be seen running, and to be sampled (every 5 s)
    job = stack.submit(chatty_spec(ws, name="chatty-live", steps=120, pause=0.3))
    page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
    expect(page.locator("#job-header h1")).to_contain_text(f"Job #{job['id']}")
    line = page.locator("#log-panel li", has_text="hello from the user's data")
    expect(line).to_have_count(1, timeout=120_000)
    # it arrived live: the job was still running when the panel had it
    assert stack.job(job["id"])["status"] == "running"
    expect(line).to_contain_text("r0")
    expect(page.locator("#job-pace")).to_contain_text("steps/s", timeout=30_000)
    expect(page.locator("#job-pace")).to_contain_text("ETA")
    expect(page.locator("#job-pace")).not_to_contain_text("— steps/s", timeout=30_000)
    # the worker's hardware samples reach both charts while it runs
    for chart in ("#hw-use-chart", "#hw-mem-chart"):
        expect(page.locator(chart)).to_have_attribute(
            "data-points", re.compile(r"^([3-9]|\d\d+)$"), timeout=90_000
        )
    assert stack.job(job["id"])["status"] == "running"
    page.screenshot(path=str(DOCS / "job-running.png"), full_page=True)
    # the rank filter keeps rank 0's lines and hides the status lines (they name no rank)
    page.select_option("#log-rank", "0")
    expect(page.locator("#log-panel li.log-status:visible")).to_have_count(0)
    expect(line).to_be_visible()
    stack.wait(job["id"], timeout=240)


def test_a_running_trials_steps_move_and_the_selection_shows_device_use(stack, page: Page) -> None:
    ws = upload_chatty(stack)
    base = chatty_spec(ws, name="sel", steps=40, pause=0.3)
    body = {"name": "browser-steps", "base": base, "space": {"train.lr": [1e-3, 3e-3]}, "method": "grid"}
    sid = stack.submit_selection(body)["id"]
    page.goto(f"{stack.base_url}/#/selections/{sid}")
    running = page.locator("#leaderboard tr[data-status='running'] .progress .label")
    seen: set[str] = set()
    deadline = time.monotonic() + 180
    # a running trial's bar moves while it runs, not only once the trial has ended (0/40 until then)
    while time.monotonic() < deadline and not any(0 < int(s.split("/")[0]) < 40 for s in seen):
        seen.update(t for t in running.all_inner_texts() if "/" in t)
        time.sleep(0.2)
    assert any(0 < int(s.split("/")[0]) < 40 for s in seen), seen
    # the group's process is sampled while it runs: the page draws its CPU use over time
    expect(page.locator("#selection-hw-chart")).not_to_have_attribute("data-points", "0", timeout=120_000)
    expect(page.locator("#selection-hardware")).to_be_visible()
    expect(page.locator("#selection-header .badge")).to_have_text("succeeded", timeout=240_000)
    page.screenshot(path=str(DOCS / "selection-hardware.png"), full_page=True)
