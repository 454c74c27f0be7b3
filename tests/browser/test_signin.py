"""The dashboard's sign-in, ownership and paged jobs table in headless Chromium against the stack.

A user signs in with a token through the form (the session cookie is HttpOnly: the page never sees
it), then watches their job stream live over EventSource; the jobs table is paged and filtered by
the server."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, expect

from db.connection import session_for
from db.jobs import create_job, request_cancel
from tests.browser.conftest import tab
from tests.browser.test_dashboard import spec

pytestmark = pytest.mark.browser


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A tab with no session: the dashboard must ask to sign in."""
    with tab(browser) as pg:
        yield pg


def test_sign_in_then_own_jobs_stream_live(stack, page: Page) -> None:  # noqa: ANN001
    name = f"b{secrets.token_hex(3)}"
    token = stack.client.post("/api/users", json={"name": name}).json()["token"]
    page.goto(f"{stack.base_url}/#/")
    form = page.locator("#signin-form")
    expect(form).to_be_visible(timeout=15_000)
    page.locator("#token-input").fill("sy_wrong")
    form.get_by_role("button", name="Sign in").click()
    expect(page.locator("#signin-result")).to_contain_text("unknown or revoked")
    page.locator("#token-input").fill(token)
    form.get_by_role("button", name="Sign in").click()
    expect(page.locator("#whoami-name")).to_have_text(name)
    expect(page.locator("#live-state")).to_have_text("live", timeout=15_000)
    assert "shardyard_session" not in page.evaluate("document.cookie")  # HttpOnly

    # the admin's jobs are not this user's: none shows; the user's own job does, with its owner
    stack.submit(spec(seed=11, steps=2))
    job = stack.client.post(
        "/api/jobs", json=spec(seed=12), headers={"Authorization": f"Bearer {token}"}
    ).json()
    row = page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]')
    expect(row).to_have_attribute("data-status", "succeeded", timeout=120_000)
    expect(row.locator("td.owner")).to_have_text(name)
    expect(page.locator("#jobs-table tbody tr")).to_have_count(1)

    # the job page streams over EventSource on the cookie alone
    page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
    expect(page.locator("#job-header .badge")).to_have_text("succeeded", timeout=60_000)
    expect(page.locator("#loss-chart")).not_to_have_attribute("data-points", "0", timeout=15_000)

    # a submit from the form carries the CSRF token; sign out ends the session
    page.goto(f"{stack.base_url}/#/")
    page.locator("#spec-input").fill('{"name": "from-form", "train": {"steps": 1, "eval_every": 1}}')
    page.get_by_role("button", name="Submit job").click()
    expect(page.locator("#submit-result")).to_have_class("ok")
    page.locator("#sign-out").click()
    expect(page.locator("#signin-form")).to_be_visible()
    page.reload()
    expect(page.locator("#signin-form")).to_be_visible()


def test_jobs_table_is_paged_and_filtered_by_the_server(stack, page: Page) -> None:  # noqa: ANN001
    tag = f"pg{secrets.token_hex(3)}"
    with session_for(stack.stack.database_url) as s:
        for i in range(60):
            # rows only (no message is sent): cancelled at once, so no worker ever runs them
            job = create_job(s, name=f"{tag}-{i}", spec=spec(), steps=1)
            request_cancel(s, job_id=job.id)
    ctx = page.context
    assert ctx.request.post(f"{stack.base_url}/api/auth/session", data={"token": stack.token}).ok
    page.goto(f"{stack.base_url}/#/")
    expect(page.locator("#live-state")).to_have_text("live", timeout=15_000)
    page.locator("#filter-name").fill(tag)
    info = page.locator("#jobs-page-info")
    expect(info).to_have_text("1–50 of 60", timeout=10_000)
    expect(page.locator("#jobs-table tbody tr")).to_have_count(50)
    page.locator("#page-next").click()
    expect(info).to_have_text("51–60 of 60")
    expect(page.locator("#jobs-table tbody tr")).to_have_count(10)
    expect(page.locator(f'#jobs-table tr[data-job-id] >> text="{tag}-0"')).to_be_visible()
    page.locator("#filter-status").select_option("succeeded")
    expect(info).to_have_text("0 jobs")
    page.locator("#filter-status").select_option("cancelled")
    page.locator("#filter-name").fill(f"{tag}-5")  # -5 and -50..-59
    expect(info).to_have_text("1–11 of 11")


def test_revoking_the_token_signs_the_dashboard_out_with_the_reason(stack, page: Page) -> None:  # noqa: ANN001
    """The session and its open EventSource die with the token they came from; the page says so."""
    user = stack.client.post("/api/users", json={"name": f"r{secrets.token_hex(3)}"}).json()
    page.goto(f"{stack.base_url}/#/")
    page.locator("#token-input").fill(user["token"])
    page.locator("#signin-form").get_by_role("button", name="Sign in").click()
    expect(page.locator("#live-state")).to_have_text("live", timeout=15_000)
    tokens = stack.client.get("/api/tokens").json()["items"]
    first = next(t for t in tokens if t["user_id"] == user["user"]["id"] and t["kind"] == "api")
    assert stack.client.delete(f"/api/tokens/{first['id']}").status_code == 200
    # nothing is clicked: the stream's last frame signs the page out
    expect(page.locator("#signin-form")).to_be_visible(timeout=30_000)
    expect(page.locator("#signin-result")).to_contain_text("revoked")
    page.reload()
    expect(page.locator("#signin-form")).to_be_visible()
