"""What every browser test shares: Debian's Chromium driven by Playwright (Playwright's own browser
download is never used), one per test module, and a tab signed in as the stack's admin."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} missing: apt-get install chromium"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser, stack) -> Iterator[Page]:  # noqa: ANN001 - the StackHandle fixture
    """A tab signed in as the stack's admin (the session cookie from POST /api/auth/session)."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    resp = ctx.request.post(f"{stack.base_url}/api/auth/session", data={"token": stack.token})
    assert resp.ok, resp.text()
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, f"uncaught errors in the page: {errors}"
