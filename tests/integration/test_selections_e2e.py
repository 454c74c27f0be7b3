"""A selection batch over HTTP on the real stack: a Celery worker runs its trials with shard
alternation over 2 CPU devices; the leaderboard, early stopping, the stream and growing the batch."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TINY_SPEC, StackHandle, grid_batch
from tests.sse import read_sse
from tests.user_data import held_data, upload_held

pytestmark = pytest.mark.integration

BASE = {**TINY_SPEC, "name": "sel", "train": {**TINY_SPEC["train"], "steps": 24, "eval_every": 4}}


def test_batch_of_six_with_asha_then_grown(stack: StackHandle) -> None:
    body = grid_batch(
        "lr-search",
        BASE,
        {"train.lr": [1e-4, 3e-4, 1e-3, 3e-3, 6e-3, 1e-2]},
        devices=2,
        scheduler="shard-lrtf",
        early_stopping={"kind": "asha", "reduction_factor": 3, "min_steps": 4},
    )
    sel = stack.submit_selection(body)
    assert len(sel["trials"]) == 6 and {t["status"] for t in sel["trials"]} == {"queued"}

    frames: list = []
    t = threading.Thread(
        target=lambda: frames.extend(read_sse(stack.base_url, f"/api/selections/{sel['id']}/stream"))
    )
    t.start()
    done = stack.wait_selection(sel["id"])
    t.join(timeout=60)

    assert done["status"] == "succeeded"
    trials = {tr["id"]: tr for tr in done["trials"]}
    assert all(tr["status"] in ("succeeded", "stopped_early") for tr in trials.values())
    stopped = [tr for tr in trials.values() if tr["stopped_early"]]
    assert stopped, "ASHA with reduction factor 3 over 6 trials stops some of them"
    assert all(tr["steps_done"] < BASE["train"]["steps"] for tr in stopped)
    # each stopped trial says why: its rung, its value there and the rung's cut-off
    for tr in stopped:
        why = stack.client.get(f"/api/jobs/{tr['job_id']}").json()["result"]["stop_reason"]
        assert why["rung"] == tr["steps_done"] and why["value"] >= why["cutoff"]
    # the leaderboard is sorted by each trial's best val_loss, and the best is really the lowest
    board = [trials[i]["best_metric"] for i in done["leaderboard"]]
    assert board == sorted(board) and len(board) == 6
    # each trial's stored series matches its best_metric
    for tr in trials.values():
        series = stack.client.get(f"/api/jobs/{tr['job_id']}/metrics", params={"names": "val_loss"}).json()
        assert min(series["series"]["val_loss"]["values"]) == pytest.approx(tr["best_metric"])
    # the stream carried every trial's metrics
    streamed = {d["trial_id"] for _, ev, d in frames if ev == "metric"}
    assert streamed == set(trials)

    # grow the finished batch: one more trial, warm-started from the best one
    best = done["leaderboard"][0]
    grown = stack.client.post(
        f"/api/selections/{sel['id']}/trials", json={"params": [{"train.lr": 2e-3}], "warm_start_from": best}
    )
    assert grown.status_code == 201, grown.text
    again = stack.wait_selection(sel["id"])
    new = [tr for tr in again["trials"] if tr["id"] not in trials]
    assert len(new) == 1 and new[0]["status"] in ("succeeded", "stopped_early")
    assert new[0]["params"] == {"train.lr": 2e-3} and new[0]["warm_start_from"] == best


def test_invalid_selections_are_refused(stack: StackHandle) -> None:
    def post(**over: Any) -> tuple[int, str]:
        body = {"base": BASE, "space": {"train.lr": [1e-3]}, "method": "grid", **over}
        r = stack.client.post("/api/selections", json=body)
        return r.status_code, r.json()["detail"] if r.status_code != 201 else ""

    code, msg = post(space={"train.learning_rate": [1]})
    assert code == 422 and "train.learning_rate" in msg
    code, msg = post(space={"train.lr": []})
    assert code == 422 and "empty" in msg
    code, msg = post(space={"train.lr": {"low": 1e-2, "high": 1e-3}}, method="random", trials=2)
    assert code == 422 and "low" in msg
    code, msg = post(space={"model.heads": [2, 3]})
    assert code == 422 and "trial 1" in msg and "divisible" in msg
    for over, field, rule in [
        ({"checkpoints": "latest"}, "checkpoints", "'best', 'all' or 'none'"),
        ({"early_stopping": {"kind": "median"}}, "early_stopping.kind", "'asha', 'sha' or 'hyperband'"),
        ({"method": "tpe"}, "", "method tpe needs trials"),
        ({"parallel": 2}, "", "parallel is for the samplers"),
        ({"method": "anneal", "trials": 4}, "method", "'tpe', 'cmaes' or 'qmc'"),
    ]:
        r = stack.client.post("/api/selections", json={"base": BASE, "space": {"train.lr": [1e-3]}, **over})
        detail = str(r.json()["detail"])
        assert r.status_code == 422 and field in detail and rule in detail, (over, detail)
    code, msg = post(method="cmaes", trials=4)
    assert code == 422 and "method cmaes searches numeric ranges" in msg
    assert stack.client.get("/api/selections/999999").status_code == 404


def test_cancel_a_running_batch_and_stop_one_trial(stack: StackHandle) -> None:
    long = {**BASE, "train": {**BASE["train"], "steps": 100_000, "eval_every": 50}}
    body = {"base": long, "space": {"train.lr": [1e-3, 2e-3, 3e-3]}, "method": "grid", "devices": 2}
    sel = stack.client.post("/api/selections", json=body).json()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        cur = stack.client.get(f"/api/selections/{sel['id']}").json()
        if cur["status"] == "running" and any(t["status"] == "running" for t in cur["trials"]):
            break
        time.sleep(0.2)
    victim = next(t for t in cur["trials"] if t["status"] == "running")
    stopped = stack.client.post(f"/api/selections/{sel['id']}/trials/{victim['id']}/stop")
    assert stopped.status_code == 200
    deadline = time.monotonic() + 60
    while (
        stack.client.get(f"/api/selections/{sel['id']}").json()["trials"][victim["index"]]["status"]
        != "stopped"
    ):
        assert time.monotonic() < deadline, "the stopped trial did not end"
        time.sleep(0.2)
    assert stack.client.post(f"/api/selections/{sel['id']}/cancel").status_code == 200
    done = stack.wait_selection(sel["id"], timeout=120)
    assert done["status"] == "cancelled"
    assert all(t["status"] in ("stopped", "cancelled") for t in done["trials"])
    assert all(t["steps_done"] < 100_000 for t in done["trials"])
    assert stack.client.post(f"/api/selections/{sel['id']}/cancel").status_code == 409


def test_stream_resumes_mid_batch_with_last_event_id(stack: StackHandle, gate: Path) -> None:
    """The selection stream cut mid-batch and reopened with the last id it gave: the two parts
    together carry every point of every trial once, the same points a fresh stream replays."""
    # each trial waits at its 20th batch until the gate goes, so the cut lands mid-batch whatever
    # the machine's speed (the unheld batch could end between the cut and the check below)
    base = {**BASE, **held_data(upload_held(stack), gate, hold_at=20)}
    body = {
        "name": "resume",
        "base": {**base, "train": {**BASE["train"], "steps": 40, "eval_every": 10}},
        "space": {"train.lr": [1e-3, 3e-3, 6e-3]},
        "method": "grid",
        "devices": 1,
    }
    sid = stack.submit_selection(body)["id"]
    path = f"/api/selections/{sid}/stream"
    # the three trials' states, the batch's status, then a dozen points: cut there
    first = read_sse(stack.base_url, path, stop_after=3 + 1 + 12)
    assert stack.client.get(f"/api/selections/{sid}").json()["status"] not in ("succeeded", "failed")
    gate.unlink()
    ids = [fid for fid, ev, _ in first if ev == "metric"]
    assert ids and all(fid is not None for fid in ids)
    second = read_sse(stack.base_url, path, last_event_id=ids[-1])
    assert [d["status"] for _, ev, d in second if ev == "status"][-1] == "succeeded"
    full = read_sse(stack.base_url, path)

    def points(frames: list) -> list[tuple]:
        return [(d["trial_id"], d["name"], d["step"], d["value"]) for _, ev, d in frames if ev == "metric"]

    got = points(first) + points(second)
    assert len(got) == len(set(got)), "a point came twice"
    # the training points, exactly. A hardware sample is stored once per (name, step), the later
    # sample at a step replacing the earlier (workers/hardware.py): a trial that waits its turn, or
    # is held, for longer than the sampling period is sampled twice at one step, and the stream
    # carried the value it had then. So of those, every (trial, name, step) came, whatever value.
    # (Comparing them exactly failed whenever the batch ran long enough: on a loaded machine too.)
    trained, fresh = ([p for p in ps if not p[1].startswith("hw.")] for ps in (got, points(full)))
    assert sorted(trained) == sorted(fresh)
    keys = {p[:3] for p in got}
    assert keys == {p[:3] for p in points(full)}
    # and that is every point of every trial in the database
    sel = stack.client.get(f"/api/selections/{sid}").json()
    total = 0
    for tr in sel["trials"]:
        series = stack.client.get(f"/api/jobs/{tr['job_id']}/metrics").json()["series"]
        total += sum(len(s["steps"]) for s in series.values())
    assert len(keys) == total
    loss_steps = sorted(st for tid, name, st, _ in got if name == "loss" and tid == sel["trials"][0]["id"])
    assert loss_steps == list(range(1, 41))


def test_trials_count_against_the_owners_quota_and_stop_at_max_runtime(stack: StackHandle) -> None:
    """A user allowed one running job: while their batch's group trains, their job waits queued
    with the quota as its reason; the group stops at the base spec's max_runtime_s (its trial
    fails with the reason), and then the job runs."""
    name = f"q{secrets.token_hex(4)}"
    made = stack.client.post("/api/users", json={"name": name, "max_running_jobs": 1}).json()
    with httpx.Client(
        base_url=stack.base_url, timeout=30, headers={"Authorization": f"Bearer {made['token']}"}
    ) as cu:
        base = {
            **BASE,
            "max_runtime_s": 4,
            "train": {**BASE["train"], "steps": 1_000_000, "eval_every": 1000},
        }
        body = {"name": "timed", "base": base, "space": {"train.lr": [1e-3]}, "method": "grid", "devices": 1}
        resp = cu.post("/api/selections", json=body)
        assert resp.status_code == 201, resp.text
        sid = resp.json()["id"]
        deadline = time.monotonic() + 120
        while cu.get(f"/api/selections/{sid}").json()["trials"][0]["status"] != "running":
            assert time.monotonic() < deadline, "the trial never started"
            time.sleep(0.2)
        short = {**TINY_SPEC, "name": "after", "train": {**TINY_SPEC["train"], "steps": 3, "eval_every": 3}}
        job = cu.post("/api/jobs", json=short).json()
        held = stack.wait_until(job["id"], lambda j: j["wait_reason"] is not None, timeout=60)
        assert held["status"] == "queued"
        assert f"1 of {name}'s jobs are running, the quota is 1" in held["wait_reason"]
        done = stack.wait_selection(sid, timeout=120)
        (trial,) = done["trials"]
        assert done["status"] == "failed" and trial["status"] == "failed"
        trial_job = stack.job(trial["job_id"])
        assert "max_runtime_s (4 s over all its attempts" in trial_job["error"], trial_job["error"]
        assert trial_job["run_seconds"] >= 4
        # the group's end sent the user's waiting job again
        ended = stack.wait(job["id"], ("succeeded",), timeout=180)
        assert ended["wait_reason"] is None
