"""What every browser test shares: Debian's Chromium driven by Playwright (Playwright's own browser
download is never used), one per test module, and a tab signed in as the stack's admin."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def tab(browser: Browser, *, token: str | None = None, base_url: str = "") -> Iterator[Page]:
    """A tab, signed in with `token` (the session cookie from POST /api/auth/session) or with no
    session; an uncaught error in the page fails the test when the tab closes."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    if token is not None:
        resp = ctx.request.post(f"{base_url}/api/auth/session", data={"token": token})
        assert resp.ok, resp.text()
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def page(browser: Browser, stack) -> Iterator[Page]:  # noqa: ANN001 - the StackHandle fixture
    """A tab signed in as the stack's admin."""
    with tab(browser, token=stack.token, base_url=stack.base_url) as pg:
        yield pg
