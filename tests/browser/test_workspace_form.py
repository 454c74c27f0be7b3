"""The dashboard's submit form with a user's own model: pick the python-model example, upload a
workspace archive through the file input, submit, and the job trains to the end (real Chromium,
real stack). A malicious archive shows the server's reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.archives import MALICIOUS, targz
from tests.browser.test_dashboard import CHROMIUM, CHROMIUM_ARGS
from tests.trainer.user_model_src import USER_MODEL

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, errors


def test_user_model_from_an_uploaded_workspace(stack, page: Page, tmp_path: Path) -> None:  # noqa: ANN001
    archive = tmp_path / "userlm.tar.gz"
    archive.write_bytes(targz({"userlm/__init__.py": b"", "userlm/model.py": USER_MODEL.encode()}))
    evil = tmp_path / "evil.tar.gz"
    evil.write_bytes(MALICIOUS["tar symlink"][0])

    page.goto(f"{stack.base_url}/#/")
    page.locator("#spec-template").select_option("your model (python entry point)")
    box = page.locator("#spec-input")
    assert json.loads(box.input_value())["model"]["kind"] == "python"

    page.locator("#workspace-file").set_input_files(str(evil))
    expect(page.locator("#workspace-status")).to_contain_text("is a symlink")

    page.locator("#workspace-file").set_input_files(str(archive))
    expect(page.locator("#workspace-status")).to_contain_text("set in the spec")
    spec = json.loads(box.input_value())
    assert spec["workspace"].startswith("sha256:")
    spec["model"] = {"kind": "python", "entry": "userlm.model:make", "args": {"width": 16}, "seq_len": 16}
    spec["data"] = {"kind": "text", "corpus": "stdlib", "max_chars": 100_000}
    spec["train"] = {"steps": 10, "batch_size": 4, "lr": 0.003, "eval_every": 10}
    box.fill(json.dumps(spec))
    page.get_by_role("button", name="Submit job").click()
    result = page.locator("#submit-result")
    expect(result).to_have_class("ok")
    job_id = int(result.locator("a").inner_text().removeprefix("job #"))
    done = stack.wait(job_id, timeout=180)
    assert done["spec"]["model"]["kind"] == "python" and done["result"]["steps"] == 10
