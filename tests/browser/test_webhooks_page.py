"""The dashboard's Webhooks page in headless Chromium against the stack: add a webhook (its secret
shown once), see a refused URL's rule, list it, open its delivery log, delete it."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

pytestmark = pytest.mark.browser

# a public address literal: accepted without a name lookup; the webhook is deleted before any
# job of the admin ends, so nothing is sent to it
TARGET = "https://93.184.215.14/shardyard-hook"


def test_add_list_and_delete_a_webhook(stack, page: Page) -> None:  # noqa: ANN001
    page.goto(f"{stack.base_url}/#/webhooks")
    form = page.locator("#webhook-form")
    expect(form).to_be_visible(timeout=15_000)

    page.locator("#webhook-url").fill("http://127.0.0.1:9/h")
    form.locator("button[type=submit]").click()
    expect(page.locator("#webhook-result")).to_contain_text("non-public address")

    page.locator("#webhook-url").fill(TARGET)
    page.locator("#webhook-events").select_option("failures")
    form.locator("button[type=submit]").click()
    secret = page.locator("#webhook-secret")
    expect(secret).to_contain_text("whsec_")
    row = page.locator("#webhooks-table tbody tr", has_text=TARGET)
    expect(row).to_contain_text("failures")
    hook_id = int(row.get_attribute("data-webhook-id") or 0)
    listed = stack.client.get("/api/webhooks").json()["items"]
    assert [(h["url"], h["events"]) for h in listed if h["id"] == hook_id] == [(TARGET, "failures")]

    row.get_by_role("button", name="Deliveries").click()
    expect(page.locator("#webhook-deliveries")).to_contain_text("Nothing delivered yet")

    row.get_by_role("button", name="Delete").click()
    expect(page.locator("#webhooks-table tbody tr", has_text=TARGET)).to_have_count(0)
    assert hook_id not in [h["id"] for h in stack.client.get("/api/webhooks").json()["items"]]
