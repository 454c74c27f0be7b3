"""A job's own metrics and its weights on its page, in Debian's Chromium against the real stack:
a workspace model reporting accuracy (trainer/report.py) gets a chart per name, filled live from
the stream while it runs and from the REST backfill once it ended, and the page links the job's
newest checkpoint, which downloads as the job's file."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from tests.archives import targz, upload
from tests.integration.test_checkpoint_download import SPEC
from tests.integration.test_user_metrics import spec
from tests.trainer.user_metrics_src import USER_METRICS

pytestmark = pytest.mark.browser


def test_the_job_page_charts_the_jobs_own_metrics_and_links_its_weights(stack, page: Page) -> None:
    ws = upload(stack, targz({"scored.py": USER_METRICS.encode()}), name="scored-page").json()["ref"]
    job = stack.submit(spec(ws, steps=150, eval_every=50))
    page.goto(f"{stack.base_url}/#/jobs/{job['id']}")
    live = page.locator("#metric-chart-accuracy")
    expect(live).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"), timeout=120_000)
    stack.wait(job["id"], timeout=240)

    page.reload()
    for name, chart in [
        ("accuracy", "accuracy"),
        ("val_accuracy", "val_accuracy"),
        ("data/class0", "data_class0"),
    ]:
        el = page.locator(f"#metric-chart-{chart}")
        expect(el).to_have_attribute("data-metric", name, timeout=30_000)
        expect(el).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))
    # the trainer's own metrics keep their charts; none of them gets one of these
    expect(page.locator(".user-metric-chart")).to_have_count(3)

    link = page.locator("#job-download")
    expect(link).to_have_attribute("href", f"/api/jobs/{job['id']}/checkpoint")
    expect(link).to_contain_text("download checkpoint (step 150,")
    with page.expect_download() as got:
        link.click()
    assert got.value.suggested_filename == f"job-{job['id']}-step-150.pt"

    # a job with no whole checkpoint says why instead of offering one
    piped = stack.submit(
        {**SPEC, "name": "pieces", "parallel": {"pipeline": {"stages": 2, "microbatches": 2}}}
    )
    stack.wait_until(piped["id"], lambda j: j["status"] != "queued", timeout=120)
    page.goto(f"{stack.base_url}/#/jobs/{piped['id']}")
    expect(page.locator("#job-no-download")).to_contain_text("in 2 pieces", timeout=30_000)
    expect(page.locator("#job-download")).to_have_count(0)
    stack.client.post(f"/api/jobs/{piped['id']}/cancel")
