"""The dashboard's handling of the jobs-wide stream's `deleted` and `resync` events, in headless
Chromium against a stack of this module's own (redis-server + the API, no worker: the jobs are
written straight into the database, which also keeps them off the broker)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, expect

from api.stack import Stack
from db.connection import session_for
from db.jobs import JobStatus, claim_job, create_job, finish_job
from tests.browser.test_dashboard import spec

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def events_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(
        root=tmp_path_factory.mktemp("events"), workers=0, extra_env={"SHARDYARD_SSE_KEEPALIVE_S": "1"}
    )
    st.start()
    try:
        yield st
    finally:
        st.stop()


TRACK_STREAMS = """(() => {
    const Base = window.EventSource;
    window.__streams = [];
    window.EventSource = class extends Base {
        constructor(...args) {
            super(...args);
            window.__streams.push(this);
        }
    };
})()"""
EVENTS_OPEN = "() => window.__streams.some((es) => es.url.endsWith('/api/events') && es.readyState === 1)"


def _job(st: Stack, name: str, *, finished: bool) -> int:
    """A job written to the database only: nothing about it is published."""
    with session_for(st.database_url) as s:
        job = create_job(s, name=name, spec=spec(steps=1), steps=1)
        if finished:
            attempt = claim_job(s, job_id=job.id, owner="test", worker="test", lease_s=60)
            assert attempt is not None
            assert finish_job(s, attempt=attempt, status=JobStatus.succeeded) is not None
        return job.id


def test_deleted_drops_the_row_and_marks_the_page_and_resync_reloads(
    events_stack: Stack, browser: Browser
) -> None:
    st = events_stack
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    assert ctx.request.post(f"{st.base_url}/api/auth/session", data={"token": st.admin_token}).ok
    errors: list[str] = []
    table, detail = ctx.new_page(), ctx.new_page()
    # the job page shows no state of its jobs-wide stream (the table shows "live"): keep its
    # EventSources where the test can see whether that stream is open
    detail.add_init_script(TRACK_STREAMS)
    for pg in (table, detail):
        pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        gone, kept = _job(st, "to-delete", finished=True), _job(st, "kept", finished=True)
        table.goto(f"{st.base_url}/#/")
        expect(table.locator("#live-state")).to_have_text("live", timeout=15_000)
        rows = table.locator("#jobs-table tbody tr[data-job-id]")
        expect(rows).to_have_count(2, timeout=15_000)
        detail.goto(f"{st.base_url}/#/jobs/{gone}")
        expect(detail.locator("#job-header .badge")).to_have_text("succeeded", timeout=15_000)
        # its jobs-wide stream is open before the delete: a delete published before it had
        # subscribed would never reach it (the badge comes from a GET, the stream on its own)
        detail.wait_for_function(EVENTS_OPEN, timeout=15_000)
        table.evaluate("window.__noReload = true")

        headers = {"Authorization": f"Bearer {st.admin_token}"}
        assert httpx.delete(f"{st.base_url}/api/jobs/{gone}", headers=headers).status_code == 204
        # the table drops the row live; the job's own page says it is gone
        expect(table.locator(f'#jobs-table tr[data-job-id="{gone}"]')).to_have_count(0, timeout=15_000)
        expect(table.locator(f'#jobs-table tr[data-job-id="{kept}"]')).to_have_count(1)
        expect(detail.locator("#job-deleted")).to_be_visible(timeout=15_000)
        expect(detail.locator("#job-header .badge")).to_have_text("deleted")

        # a job the broker never announced, then the broker restarts: the stream sends `resync`
        # (the API and the page stay connected, so nothing else reloads the table) and the table
        # refetches and shows it
        silent = _job(st, "silent", finished=True)
        st.restart_redis()
        expect(table.locator(f'#jobs-table tr[data-job-id="{silent}"]')).to_have_count(1, timeout=30_000)
        expect(table.locator("#live-state")).to_have_text("live")
        assert table.evaluate("window.__noReload") is True  # the same document all along
    finally:
        ctx.close()
    assert not errors, f"uncaught errors in the page: {errors}"
