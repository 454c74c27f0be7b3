"""The dashboard's views for starting and reading searches, in a real browser on the real stack: the
new-selection form (refusals next to their fields), clone / re-run from a job and a batch, the queue
page with each waiting job's reason, a batch's best-so-far curve and parameter importance, and the
compare view's table of parameters, best metric and true status. The screenshots in docs/ of these
views are written here.

Two tests on the shared stack: one holds its worker's two tasks with two held jobs (so what is
submitted next waits, and the queue has entries), the other reads a finished batch written straight
to the database (its trials' parameters and metrics chosen, so which parameter drives the metric is
known)."""

from __future__ import annotations

import json
import math
import random
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from db.connection import session_for
from db.models import Job, MetricPoint, Selection, Trial, User, utcnow
from jobrules.spec import JobSpec
from tests.browser.test_dashboard import spec
from tests.user_data import held_data, upload_held

pytestmark = pytest.mark.browser

DOCS = Path(__file__).resolve().parents[2] / "docs"


def fmt_num(v: float) -> str:
    """A number as the dashboard prints it (frontend/src/dom.ts fmtNum)."""
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        mantissa, exp = f"{v:.2e}".split("e")
        return f"{mantissa}e{int(exp):+d}"
    x = float(f"{v:.4g}")
    return str(int(x)) if x == int(x) else repr(x)


def safetensors_header(body: bytes) -> dict[str, Any]:
    """A safetensors file's header: its length (8 bytes, little-endian), then that much JSON."""
    n = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + n])


def wait_status(stack, job_id: int, statuses: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = stack.job(job_id)
        if job["status"] in statuses:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not {statuses} after {timeout}s: {stack.job(job_id)}")


def submit_from_the_form(stack, page: Page) -> int:  # noqa: ANN001
    """The new-selection form: an example to start from, refusals next to their fields; the batch
    it submits."""
    page.goto(f"{stack.base_url}/#/selections")
    page.locator("#new-selection").click()
    expect(page.locator("#selection-form")).to_be_visible()
    expect(page.locator("#sel-method")).to_have_value("random")
    page.locator("#sel-name").fill("views-form")
    page.locator("#sel-base").fill(json.dumps(spec(steps=8, eval_every=4)))
    row = page.locator("#space-table tr.space-row").first
    expect(row.locator(".space-path")).to_have_value("train.lr")
    row.locator(".space-low").fill("0.01")
    row.locator(".space-high").fill("0.001")
    page.locator("#sel-trials").fill("0")
    # a grid takes no trials count: the field goes while grid is picked
    page.locator("#sel-method").select_option("grid")
    expect(page.locator("#sel-trials")).to_be_hidden()
    page.locator("#sel-method").select_option("random")
    expect(page.locator("#sel-trials")).to_be_visible()

    page.locator("#sel-submit").click()
    trials_error = page.locator('[data-error-for="trials"]')
    expect(trials_error).to_contain_text("greater than or equal to 1")
    page.locator("#sel-trials").fill("2")
    page.locator("#sel-submit").click()
    # the route's own check of the space: next to that dimension's row
    expect(row.locator(".field-error")).to_contain_text("low (0.01) must be < high (0.001)")
    expect(trials_error).to_be_hidden()
    row.locator(".space-low").fill("0.001")
    row.locator(".space-high").fill("0.01")
    page.locator("#sel-submit").click()
    expect(page).to_have_url(re.compile(r"#/selections/\d+$"))
    return int(page.url.rsplit("/", 1)[1])


def check_the_batch_clone(page: Page, batch: int) -> None:
    """Clone / re-run a batch (from its page): the form filled with its request."""
    page.locator("#selection-clone").click()
    expect(page.locator("#selection-form h1, h1").first).to_contain_text(f"cloned from #{batch}")
    expect(page.locator("#sel-name")).to_have_value("views-form")
    expect(page.locator("#sel-trials")).to_have_value("2")
    expect(page.locator("#sel-stopping")).to_have_value("asha")
    expect(page.locator("#space-table .space-path").first).to_have_value("train.lr")
    assert json.loads(page.locator("#sel-base").input_value())["train"]["steps"] == 8
    page.locator("#sel-example").evaluate("el => el.scrollIntoView()")
    page.screenshot(path=str(DOCS / "selection-form.png"), full_page=True)


def rerun_a_job(stack, page: Page, job_id: int) -> int:  # noqa: ANN001
    """Clone / re-run a job: the submit form filled with its spec; the job it submits."""
    page.goto(f"{stack.base_url}/#/jobs/{job_id}")
    page.locator("#job-clone").click()
    expect(page).to_have_url(re.compile(rf"#/\?clone={job_id}$"))
    expect(page.locator("#submit-origin")).to_contain_text(f"job #{job_id}")
    box = page.locator("#spec-input")
    expect(box).to_have_value(re.compile('"views-held"'))
    assert json.loads(box.input_value()) == stack.job(job_id)["spec"]
    page.get_by_role("button", name="Submit job").click()
    expect(page.locator("#submit-result a")).to_have_text(re.compile(r"job #\d+"))
    rerun = int(page.locator("#submit-result a").inner_text().split("#")[1])
    assert stack.job(rerun)["spec"] == stack.job(job_id)["spec"]
    return rerun


def check_the_queue(stack, page: Page, *, batch: int, trial_job: int, rerun: int) -> None:  # noqa: ANN001
    """The queue: every waiting entry, its place, owner, time waited and real reason."""
    # every entry's reason is written by the scheduler's next tick after its submit
    deadline = time.monotonic() + 30
    while True:
        entries = stack.client.get("/api/queue").json()["items"]
        if all(e["wait_reason"] for e in entries) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    page.goto(f"{stack.base_url}/#/queue")
    assert {e["job_id"] for e in entries} >= {rerun, trial_job}
    rows = page.locator("#queue-table tbody tr[data-job-id]")
    expect(rows).to_have_count(len(entries))
    for e in entries:
        tr = page.locator(f'#queue-table tr[data-job-id="{e["job_id"]}"]')
        expect(tr.locator('[data-col="position"]')).to_have_text(str(e["position"]))
        expect(tr.locator('[data-col="owner"]')).to_have_text(e["owner"])
        assert e["wait_reason"], e
        expect(tr.locator('[data-col="reason"]')).to_have_text(e["wait_reason"], timeout=15_000)
        expect(tr.locator('[data-col="waited"]')).to_have_text(re.compile(r"^\d+:\d\d$"))
    group = page.locator(f'#queue-table tr[data-job-id="{trial_job}"]')
    expect(group.locator('[data-col="job"]')).to_contain_text(f"batch #{batch}")
    positions = [int(x) for x in rows.locator('[data-col="position"]').all_inner_texts()]
    assert positions == sorted(positions)
    page.screenshot(path=str(DOCS / "queue.png"), full_page=True)


def check_the_downloads(stack, page: Page, *, job_id: int, batch: int) -> None:  # noqa: ANN001
    """Downloads: a finished job's weights as safetensors, a batch's best trial in one click."""
    page.goto(f"{stack.base_url}/#/jobs/{job_id}")
    link = page.locator("#job-download-safetensors")
    expect(link).to_contain_text("download weights (safetensors")
    got = page.request.get(stack.base_url + (link.get_attribute("href") or ""))
    assert got.ok, got.text()
    header = safetensors_header(got.body())
    assert header["__metadata__"]["job_id"] == str(job_id)
    assert header["0.tok.weight"]["shape"] == [13, 32]  # the held data's 13 tokens, d_model 32
    done = stack.wait_selection(batch)
    assert done["status"] == "succeeded", done
    page.goto(f"{stack.base_url}/#/selections/{batch}")
    best = next(t for t in done["trials"] if t["id"] == done["leaderboard"][0])
    link = page.locator("#selection-download-best")
    expect(link).to_contain_text(f"trial {best['index']}: weights (safetensors)")
    got = page.request.get(stack.base_url + (link.get_attribute("href") or ""))
    assert got.ok, got.text()
    assert got.headers["x-job-id"] == str(best["job_id"])
    assert safetensors_header(got.body())


def test_new_selection_clone_and_queue(stack, page: Page, gate: Path) -> None:
    # two held jobs take the worker's two tasks: whatever is submitted next waits in the queue
    held = {**spec(steps=20, eval_every=20), **held_data(upload_held(stack), gate, hold_at=2)}
    held["name"] = "views-held"
    holders = [stack.submit(held)["id"] for _ in range(2)]
    for jid in holders:
        wait_status(stack, jid, ("running",))
    queued: list[int] = []
    batch = None
    try:
        batch = submit_from_the_form(stack, page)
        got = stack.client.get(f"/api/selections/{batch}").json()
        req = got["request"]
        assert (req["name"], req["method"], req["trials"]) == ("views-form", "random", 2)
        assert req["space"] == {"train.lr": {"low": 0.001, "high": 0.01, "log": True}}
        assert req["early_stopping"] == {"kind": "asha", "reduction_factor": 3, "min_steps": 10}
        assert req["base"]["train"]["steps"] == 8
        queued += [t["job_id"] for t in got["trials"]]
        check_the_batch_clone(page, batch)
        rerun = rerun_a_job(stack, page, holders[0])
        queued.append(rerun)
        check_the_queue(stack, page, batch=batch, trial_job=queued[0], rerun=rerun)
        stack.client.post(f"/api/jobs/{rerun}/cancel")
        gate.unlink()  # the held jobs train on to their end (a checkpoint), then the batch runs
        stack.wait(holders[0])
        check_the_downloads(stack, page, job_id=holders[0], batch=batch)
    finally:
        if batch is not None:
            stack.client.post(f"/api/selections/{batch}/cancel")
        for jid in [*queued, *holders]:
            stack.client.post(f"/api/jobs/{jid}/cancel")
        gate.unlink(missing_ok=True)
        for jid in [*queued, *holders]:
            wait_status(stack, jid, ("succeeded", "failed", "cancelled"))


# ---- a finished batch written to the database ---------------------------------------------------

# 12 trials: the metric is a bowl in log10(lr) around 10^-2.5; layers are drawn at random and do
# nothing; the trials ended in an order unlike their indices
LRS = [1e-4, 3e-4, 1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 3e-2, 1e-1, 6e-4, 7e-3, 2e-2]
END_ORDER = [3, 0, 7, 1, 10, 4, 11, 2, 9, 5, 8, 6]
STOPPED = {8}  # stopped early by a rung: no trial trained to the end with it


def _value(lr: float, noise: float) -> float:
    return 1.5 + (math.log10(lr) + 2.5) ** 2 + noise


def seed_batch(stack) -> tuple[int, list[dict[str, Any]]]:  # noqa: ANN001
    """A finished random-search batch over train.lr and model.layers, its trials' jobs ended and
    their val_loss curves stored; (its id, each trial's params, value, status and job id)."""
    rng = random.Random(1)
    base = JobSpec.model_validate({**spec(steps=40, eval_every=10), "name": "views-seeded"}).model_dump()
    space = {"train.lr": {"low": 1e-4, "high": 1e-1, "log": True}, "model.layers": [2, 4]}
    request = {
        "name": "views-seeded",
        "base": base,
        "space": space,
        "method": "random",
        "trials": len(LRS),
        "devices": 2,
        "seed": 7,
        "metric": "val_loss",
        "mode": "min",
        "early_stopping": {"kind": "asha", "reduction_factor": 3, "min_steps": 10},
    }
    start = utcnow() - timedelta(minutes=30)
    out: list[dict[str, Any]] = []
    with session_for(stack.stack.database_url) as s:
        admin = s.query(User).filter(User.is_admin.is_(True)).order_by(User.id).first()
        sel = Selection(
            name="views-seeded",
            request=request,
            status="succeeded",
            metric="val_loss",
            mode="min",
            scheduler="shard-lrtf",
            owner_id=admin.id,
            created_at=start,
            started_at=start,
            finished_at=start + timedelta(minutes=13),
        )
        s.add(sel)
        s.flush()
        for i, lr in enumerate(LRS):
            params = {"train.lr": lr, "model.layers": rng.choice([2, 4])}
            value = _value(lr, rng.uniform(-0.05, 0.05))
            status = "stopped_early" if i in STOPPED else "succeeded"
            steps = 10 if i in STOPPED else 40
            trial_spec = json.loads(json.dumps(base))
            trial_spec["name"] = f"views-seeded#{i}"
            trial_spec["train"]["lr"] = lr
            trial_spec["model"]["layers"] = params["model.layers"]
            job = Job(
                name=trial_spec["name"],
                kind="trial",
                spec=trial_spec,
                status="succeeded",
                steps=40,
                step=steps,
                attempts=1,
                selection_id=sel.id,
                owner_id=admin.id,
                created_at=start,
                started_at=start,
                finished_at=start + timedelta(minutes=1 + END_ORDER.index(i)),
                result={"status": status, "best_metric": value, "steps": steps},
            )
            s.add(job)
            s.flush()
            s.add(
                Trial(
                    selection_id=sel.id,
                    index=i,
                    params=params,
                    job_id=job.id,
                    status=status,
                    steps_done=steps,
                    steps_total=40,
                    last_metric=value,
                    best_metric=value,
                    stopped_early=status == "stopped_early",
                    result={"status": status, "best_metric": value, "compute_s": 1.0, "copy_s": 0.1},
                )
            )
            for k, step in enumerate(range(10, steps + 1, 10)):
                s.add(
                    MetricPoint(
                        job_id=job.id,
                        step=step,
                        name="val_loss",
                        value=value + 2.0 / (k + 1) - 0.5,
                        time=time.time(),
                    )
                )
            out.append({"params": params, "value": value, "status": status, "job_id": job.id})
        s.commit()
        return sel.id, out


def seed_diverged_job(stack) -> int:  # noqa: ANN001
    """A finished job the worker judged diverged (its loss ended far above where it began)."""
    job_spec = JobSpec.model_validate({**spec(steps=40), "name": "views-diverged"}).model_dump()
    with session_for(stack.stack.database_url) as s:
        admin = s.query(User).filter(User.is_admin.is_(True)).order_by(User.id).first()
        now = utcnow()
        job = Job(
            name="views-diverged",
            spec=job_spec,
            status="succeeded",
            steps=40,
            step=40,
            attempts=1,
            owner_id=admin.id,
            created_at=now - timedelta(minutes=2),
            started_at=now - timedelta(minutes=2),
            finished_at=now,
            divergence=(
                "diverged: the training loss ended at 48,310 (mean of the last 4 point(s), to step 40), "
                "12,077.5x its first value 4 (step 1); the rule flags a final loss above 10x the first "
                "(train.divergence_factor)"
            ),
            result={"final_loss": 48310.0},
        )
        s.add(job)
        s.commit()
        return job.id


def test_batch_history_importance_and_compare_table(stack, page: Page) -> None:
    sid, trials = seed_batch(stack)
    diverged = seed_diverged_job(stack)
    page.goto(f"{stack.base_url}/#/selections/{sid}")

    # importance: the learning rate drives the metric, the layers do not
    imp = page.locator("#importance")
    expect(imp).to_have_attribute("data-trials", str(len(LRS) - len(STOPPED)))
    expect(imp.locator(".param").first).to_have_text("train.lr")
    share = {
        p: float(imp.locator(f'.share[data-param="{p}"]').get_attribute("data-share") or "nan")
        for p in ("train.lr", "model.layers")
    }
    assert share["train.lr"] > 0.8 > share["model.layers"], share

    # best so far, in the order the trials ended (their jobs' finished_at), not their indices
    hist = page.locator("#best-so-far-chart")
    expect(hist).to_have_attribute("data-order", ",".join(map(str, END_ORDER)))
    values = [trials[i]["value"] for i in END_ORDER]
    running = [min(values[: k + 1]) for k in range(len(values))]
    drawn = [float(x) for x in (hist.get_attribute("data-best") or "").split(",")]
    assert drawn == pytest.approx(running)
    best = min(range(len(LRS)), key=lambda i: trials[i]["value"])
    expect(page.locator("#best-so-far-note")).to_contain_text(f"trial {best}, the ")
    expect(hist).to_have_attribute("data-points", str(2 * len(LRS)))
    page.locator("#best-so-far").locator("xpath=..").screenshot(path=str(DOCS / "selection-importance.png"))

    # compare: a table of the trials' parameters, best metric and true status beside the chart
    picked = [trials[i]["job_id"] for i in (best, 8, 0)]
    page.goto(f"{stack.base_url}/#/compare?jobs={','.join(map(str, picked))}&selection={sid}")
    table = page.locator("#compare-table")
    for i in (best, 8, 0):
        tr = table.locator(f'tr[data-job-id="{trials[i]["job_id"]}"]')
        expect(tr.locator('[data-col="status"] .badge')).to_have_text(
            "stopped early" if i in STOPPED else "succeeded"
        )
        expect(tr.locator('[data-col="best"]')).to_have_text(fmt_num(trials[i]["value"]))
        expect(tr.locator('[data-col="p:train.lr"]')).to_have_text(fmt_num(trials[i]["params"]["train.lr"]))
        expect(tr.locator('[data-col="p:model.layers"]')).to_have_text(
            str(trials[i]["params"]["model.layers"])
        )
    expect(page.locator("#compare-chart")).to_have_attribute("data-points", re.compile(r"^[1-9]"))
    page.screenshot(path=str(DOCS / "compare-table.png"), full_page=True)

    # the jobs table and a job's page: a diverged run is marked beside its status; a trial's job
    # page says "stopped early" for a trial the rungs stopped (its job's status is succeeded)
    page.goto(f"{stack.base_url}/#/")
    page.locator("#filter-name").fill("views-")
    row = page.locator(f'#jobs-table tr[data-job-id="{diverged}"]')
    expect(row.locator('[data-col="status"] .badge').first).to_have_text("succeeded")
    expect(row.locator("[data-diverged]")).to_have_attribute("title", re.compile("48,310"))
    page.goto(f"{stack.base_url}/#/jobs/{diverged}")
    expect(page.locator("#job-header [data-diverged]")).to_have_text("diverged")
    expect(page.locator("#job-divergence")).to_contain_text("ended at 48,310")
    page.goto(f"{stack.base_url}/#/jobs/{trials[8]['job_id']}")
    expect(page.locator("#job-header .badge").first).to_have_text("stopped early")
