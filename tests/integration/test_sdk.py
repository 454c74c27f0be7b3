"""The Python SDK (shardyard/client.py) and the CLI's selection commands against a real stack of
this module's own (one test restarts its API): a job followed to its end, a follow that outlives
an API restart, a selection batch followed and ranked, cancels, and refusals that name the field."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.stack import Stack
from jobrules.spec import JobSpec
from shardyard.client import Client
from shardyard.errors import ApiError, ShardyardError, Unreachable
from shardyard.results import Job, MetricEvent, Selection, StatusEvent, TrialEvent
from shardyard.stream import StreamTimeout
from tests.conftest import TINY_SPEC, StackHandle, long_job, running

pytestmark = pytest.mark.integration

SMALL = {**TINY_SPEC, "name": "sdk", "train": {**TINY_SPEC["train"], "steps": 12, "eval_every": 6}}
BATCH = {
    "name": "sdk-lr",
    "base": {**SMALL, "train": {**SMALL["train"], "eval_every": 4}},
    "space": {"train.lr": [1e-3, 1e-2]},
    "method": "grid",
    "devices": 2,
}


@pytest.fixture(scope="module")
def sdk_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    st = Stack(
        root=tmp_path_factory.mktemp("sdk"),
        workers=1,
        concurrency=2,
        extra_env={"SHARDYARD_SSE_KEEPALIVE_S": "1"},
    )
    with running(st) as handle:
        yield handle


@pytest.fixture
def client(sdk_stack: StackHandle) -> Iterator[Client]:
    with Client(sdk_stack.base_url, sdk_stack.token, patience_s=120) as c:
        yield c


def loss_steps(events: list[Any]) -> list[int]:
    return [e.step for e in events if isinstance(e, MetricEvent) and e.name == "loss"]


def test_submit_and_follow_a_tiny_job_to_its_end(client: Client) -> None:
    # a JobSpec model goes in as well as a dict
    job = client.submit(JobSpec.model_validate(SMALL))
    assert isinstance(job, Job) and job.status == "queued" and job.progress.steps == 12
    events = list(job.follow())
    # every step exactly once, in order, and the stream ends with the final status
    assert loss_steps(events) == list(range(1, 13))
    assert [e.step for e in events if isinstance(e, MetricEvent) and e.name == "val_loss"] == [6, 12]
    assert isinstance(events[-1], StatusEvent) and events[-1].status == "succeeded"
    assert [e.status for e in events if isinstance(e, StatusEvent)][0] == "queued"
    done = job.wait(timeout=60)
    assert done.status == "succeeded" and done.result is not None and done.result["steps"] == 12
    assert done.finished_at is not None and done.progress.step == 12
    # following the finished job replays the same history, its final status included
    again = list(client.follow(job.id))
    assert loss_steps(again) == list(range(1, 13))
    assert [e.status for e in again if isinstance(e, StatusEvent)][-1] == "succeeded"
    listed = client.jobs(status="succeeded", name="sdk")
    assert job.id in {j.id for j in listed} and listed.total >= 1


def test_follow_resumes_across_an_api_restart(sdk_stack: StackHandle, client: Client) -> None:
    """The API process is stopped and started again while the follow is open: the follow
    reconnects with Last-Event-ID and sees every step once (its loop is paused during the
    restart, so the steps trained meanwhile reach it only through the resumed stream)."""
    steps = 200
    job = client.submit(long_job("sdk-api-restart", steps, checkpoint_every=0))
    told: list[str] = []
    events: list[Any] = []
    restarted_at: int | None = None
    for ev in client.follow(job.id, on_interrupt=told.append, on_resume=lambda: told.append("resumed")):
        events.append(ev)
        if restarted_at is None and isinstance(ev, MetricEvent) and ev.name == "loss" and ev.step >= 3:
            # the restart lands mid-job, or this test would prove nothing
            assert sdk_stack.job(job.id)["status"] == "running"
            restarted_at = ev.step
            sdk_stack.stack.restart_api()
    assert restarted_at is not None
    assert told and told[-1] == "resumed", told  # it really lost the stream and got it back
    assert loss_steps(events) == list(range(1, steps + 1))
    ids = [e.id for e in events if isinstance(e, MetricEvent)]
    assert len(ids) == len(set(ids))
    assert isinstance(events[-1], StatusEvent) and events[-1].status == "succeeded"
    assert client.get(job.id).result["steps"] == steps


def test_a_selection_followed_to_its_end_and_ranked(sdk_stack: StackHandle, client: Client) -> None:
    sel = client.submit_selection(BATCH)
    assert isinstance(sel, Selection) and len(sel.trials) == 2
    events = list(sel.follow())
    assert isinstance(events[-1], StatusEvent) and events[-1].status == "succeeded"
    assert {e.trial.id for e in events if isinstance(e, TrialEvent)} == {t.id for t in sel.trials}
    points = Counter((e.trial_id, e.name, e.step) for e in events if isinstance(e, MetricEvent))
    assert points and max(points.values()) == 1, "a point came twice"
    for t in sel.trials:
        assert [s for (tid, name, s) in sorted(points) if tid == t.id and name == "loss"] == list(
            range(1, 13)
        )
    # the stream of a batch that has ended sends its status before its points: all of them come,
    # and the SDK yields the terminal status last, as for a live batch
    replay = list(client.follow_selection(sel.id))
    assert Counter((e.trial_id, e.name, e.step) for e in replay if isinstance(e, MetricEvent)) == points
    assert [e.status for e in replay if isinstance(e, StatusEvent)] == ["succeeded"]
    assert isinstance(replay[-1], StatusEvent)
    done = client.get_selection(sel.id)
    assert done.status == "succeeded"
    board = client.leaderboard(sel.id)
    assert [r.rank for r in board] == [1, 2]
    assert board[0].best is not None and board[0].best <= board[1].best
    assert done.best is not None and done.best.id == board[0].trial.id
    assert {t.status for t in client.selection_trials(sel.id)} == {"succeeded"}

    shown = sdk_stack.cli("selection", "show", str(sel.id))
    assert shown.returncode == 0, shown.stderr
    assert "leaderboard" in shown.stdout and "train.lr=0.001" in shown.stdout
    assert "train.lr=0.01" in shown.stdout and "succeeded" in shown.stdout
    raw = sdk_stack.cli("selection", "show", str(sel.id), "--json")
    assert json.loads(raw.stdout)["leaderboard"] == done.leaderboard_ids


def test_cli_selection_submit_from_stdin_then_follow(sdk_stack: StackHandle) -> None:
    out = sdk_stack.cli("selection", "submit", "-", stdin=json.dumps({**BATCH, "name": "from-stdin"}))
    assert out.returncode == 0, out.stderr
    assert "submitted selection" in out.stdout and "2 trial(s)" in out.stdout
    sid = int(out.stdout.split("submitted selection", 1)[1].split()[0])
    followed = sdk_stack.cli("selection", "follow", str(sid))
    assert followed.returncode == 0, followed.stderr  # 0: the batch succeeded
    assert "leaderboard" in followed.stdout and "succeeded" in followed.stdout
    assert "Traceback" not in followed.stderr


def test_cli_selection_list_filters_like_the_route(sdk_stack: StackHandle, client: Client) -> None:
    """`shardyard selection list`: a table of the batches with the route's filters (status, name,
    owner, limit), and the API's page with --json; the SDK's selections() takes the same filters."""
    done = client.submit_selection({**BATCH, "name": "listed-done"})
    endless = {**SMALL, "name": "endless", "train": {**SMALL["train"], "steps": 100_000}}
    stopped = client.submit_selection({**BATCH, "name": "Listed-Stopped", "base": endless})
    stopped.cancel()
    assert stopped.wait(timeout=120).status == "cancelled"
    assert done.wait(timeout=240).status == "succeeded"

    table = sdk_stack.cli("selection", "list", "--name", "listed-")
    assert table.returncode == 0, table.stderr
    rows = {line.split()[1]: line for line in table.stdout.splitlines() if line.startswith("│")}
    assert set(rows) == {str(done.id), str(stopped.id)}, table.stdout
    assert "listed-done" in rows[str(done.id)] and "succeeded" in rows[str(done.id)]
    assert "2/2" in rows[str(done.id)] and "train.lr=" in rows[str(done.id)]  # its best trial
    assert "cancelled" in rows[str(stopped.id)] and "Listed-Stopped" in rows[str(stopped.id)]
    assert "2 of 2 selection(s)" in table.stdout

    raw = sdk_stack.cli("selection", "list", "--name", "LISTED", "--status", "cancelled", "--json")
    assert raw.returncode == 0, raw.stderr
    page = json.loads(raw.stdout)
    assert page["total"] == 1 and [s["id"] for s in page["items"]] == [stopped.id]
    assert page["items"][0]["request"]["base"]["name"] == "endless"  # the API's JSON, as sent

    limited = json.loads(
        sdk_stack.cli("selection", "list", "--name", "listed-", "--limit", "1", "--json").stdout
    )
    assert [s["id"] for s in limited["items"]] == [stopped.id] and limited["total"] == 2  # newest first
    assert [s.id for s in client.selections(status="succeeded", name="listed-")] == [done.id]
    assert client.selections(owner="nobody-by-this-name", name="listed-").total == 0

    bad = sdk_stack.cli("selection", "list", "--status", "lost")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    with pytest.raises(ApiError) as e:
        client.selections(status="lost")  # the API's 422 names the field
    assert e.value.status == 422 and e.value.fields == ["status"]


def test_cancel_a_job_and_a_batch(sdk_stack: StackHandle, client: Client) -> None:
    endless = {**SMALL, "name": "endless", "train": {**SMALL["train"], "steps": 100_000}}
    job = client.submit(endless)
    with pytest.raises(StreamTimeout, match=f"job {job.id} has not ended after 2s"):
        job.wait(timeout=2)
    assert job.cancel().cancel_requested
    assert job.wait(timeout=120).status == "cancelled"

    long_batch = {**BATCH, "name": "to-cancel", "base": endless}
    sel = client.submit_selection(long_batch)
    out = sdk_stack.cli("selection", "cancel", str(sel.id))
    assert out.returncode == 0, out.stderr
    assert f"selection {sel.id}:" in out.stdout and "cancel requested" in out.stdout
    followed = sdk_stack.cli("selection", "follow", str(sel.id))
    assert followed.returncode == 3, followed.stderr  # 3: the batch was cancelled
    assert client.wait_selection(sel.id, timeout=60).status == "cancelled"
    with pytest.raises(ApiError) as e:
        client.cancel_selection(sel.id)  # already ended: the API's 409 with its reason
    assert e.value.status == 409


def test_refusals_name_the_field(sdk_stack: StackHandle, client: Client, tmp_path: Path) -> None:
    with pytest.raises(ApiError) as e:
        client.submit({**SMALL, "train": {**SMALL["train"], "lr": 0}})
    assert isinstance(e.value, ShardyardError) and e.value.status == 422
    assert e.value.fields == ["train.lr"] and "train.lr" in str(e.value) and str(e.value).startswith("422: ")
    with pytest.raises(ApiError) as e:
        client.submit_selection({**BATCH, "devices": 0})
    assert e.value.status == 422 and e.value.fields == ["devices"]
    with pytest.raises(ApiError) as e:
        client.get(999_999)
    assert e.value.status == 404 and "999999" in e.value.message
    with pytest.raises(Unreachable) as gone:
        Client("http://127.0.0.1:9").get(1)
    assert not gone.value.lost and "cannot reach the API" in str(gone.value)
    with pytest.raises(ShardyardError, match="No such file"):
        client.upload_workspace(tmp_path / "missing")

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**BATCH, "space": {"train.lr": [1e-3]}, "group_size": 0}))
    out = sdk_stack.cli("selection", "submit", str(bad))
    assert out.returncode == 2 and "422" in out.stderr and "group_size" in out.stderr, out.stderr
    out = sdk_stack.cli("selection", "submit", "-", stdin="{nope")
    assert out.returncode == 2 and "stdin is not valid JSON" in out.stderr
    out = sdk_stack.cli("selection", "submit", "-", stdin="[1, 2]")
    assert out.returncode == 2 and "a selection request is a JSON object" in out.stderr
    out = sdk_stack.cli("selection", "show", "999999")
    assert out.returncode == 2 and "404" in out.stderr


def test_the_readme_example_runs(
    sdk_stack: StackHandle, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README.md's "Python SDK" example, as written, against this stack (the docs stay the code)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("\n## Python SDK\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'Client("http://127.0.0.1:8000", token="sy_...")' in code
    code = code.replace('Client("http://127.0.0.1:8000", token="sy_...")', "Client()")
    monkeypatch.setenv("SHARDYARD_API_URL", sdk_stack.base_url)
    monkeypatch.setenv("SHARDYARD_TOKEN", sdk_stack.token)
    scope: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the repository's own README
    lines = capsys.readouterr().out.splitlines()
    # "step loss" per point of the first job, between its log lines
    assert [int(x.split()[0]) for x in lines if re.fullmatch(r"\d+ \d+\.\d+", x)] == list(range(1, 21))
    assert [e.step for e in scope["events"] if isinstance(e, MetricEvent) and e.name == "loss"] == list(
        range(1, 21)
    )
    ranked = [line.split(" ", 1)[0] for line in lines[-2:]]
    assert ranked == ["1", "2"], lines[-4:]
