"""The dashboard's submit form with a user's own model: pick the python-model example, upload a
workspace archive through the file input, submit, and the job trains to the end (real Chromium,
real stack). A malicious archive shows the server's reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.archives import MALICIOUS, targz
from tests.trainer.user_model_src import USER_MODEL

pytestmark = pytest.mark.browser


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
