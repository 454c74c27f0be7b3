"""What a new user runs into in the first hour: a job's error that grew to megabytes, names and
labels that print as nothing, a selection batch without a bound, and the wording of the answers.
In-process (TestClient over a migrated SQLite file): no Redis, no worker."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from api.main import create_app
from core.settings import Settings
from db import jobs as dbj
from db.connection import session_for
from db.migrate import upgrade
from db.models import ERROR_MAX_CHARS, JobEvent
from tests.conftest import TINY_SPEC
from workers.pyenv import refused_error

ADMIN = "admin-token-for-the-first-use-tests"


@pytest.fixture
def db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    upgrade(url)
    return url


@pytest.fixture
def api(db: str, tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """A client of a new app on `db` (settings overridden by keyword), signed in as the admin."""
    opened: list[TestClient] = []

    def make(**over: object) -> TestClient:
        base: dict[str, object] = {"trusted_hosts": ["testserver"], "stall_log_s": 0}
        settings = Settings(
            database_url=db,
            data_dir=tmp_path,
            embedded_scheduler=False,
            admin_token=SecretStr(ADMIN),
            **{**base, **over},  # type: ignore[arg-type]
        )
        client = TestClient(create_app(settings)).__enter__()
        opened.append(client)
        client.headers["Authorization"] = f"Bearer {ADMIN}"
        return client

    yield make
    for c in opened:
        c.__exit__(None, None, None)


# ---- a job's error is capped where it is stored, and cut short in listings ----


def test_a_huge_error_is_stored_cut_to_its_head_and_tail(db: str, api: Callable[..., TestClient]) -> None:
    problems = [f"line {i}: 'pkg{i}==1.0' is not installed and may not be" for i in range(10_000)]
    summary = refused_error(problems)
    assert len(summary) < 2_000 and summary.endswith("and 9980 more problem(s)")
    huge = "environment refused: " + "; ".join(problems)  # 0.6 MB, as the worker once wrote it
    with session_for(db) as s:
        job_id = dbj.create_job(s, name="j", spec={}, steps=1).id
        attempt = dbj.claim_job(s, job_id=job_id, owner="w", worker="w", lease_s=30)
        assert attempt is not None
        assert dbj.finish_job(s, attempt=attempt, status=dbj.JobStatus.failed, error=huge)
        s.expire_all()
        stored = dbj.get_job(s, job_id).error
        event = s.query(JobEvent).filter_by(job_id=job_id, message="failed").one()
    assert stored is not None and len(stored) <= ERROR_MAX_CHARS
    assert stored.startswith("environment refused: line 0:") and stored.endswith(problems[-1])
    assert f"{len(huge)} characters in all" in stored
    assert event.data["error"] == stored
    c = api()
    whole = c.get(f"/api/jobs/{job_id}").json()["error"]
    assert whole == stored
    listed = c.get("/api/jobs").json()["items"][0]["error"]
    assert len(listed) < 700 and listed.startswith("environment refused: line 0:")
    assert f"GET /api/jobs/{job_id} has the whole error" in listed
    # the jobs table's live rows (GET /api/jobs/stream) carry the short one too
    from api.routes.events import _job_json
    from db.users import user_by_name

    with session_for(db) as s:
        admin = user_by_name(s, "admin")
    row = _job_json(Settings(database_url=db), job_id, admin)
    assert row is not None and row["error"] == listed


def test_any_write_of_an_error_is_capped(db: str) -> None:
    """An operator's reason, and an UPDATE that names the column (a search giving up), too."""
    with session_for(db) as s:
        job_id = dbj.create_job(s, name="j", spec={}, steps=1).id
        dbj.fail_job(s, job_id=job_id, reason="x" * 100_000)
        s.expire_all()
        assert len(dbj.get_job(s, job_id).error or "") <= ERROR_MAX_CHARS
        short = dbj.create_job(s, name="k", spec=dict(TINY_SPEC), steps=1).id
        dbj.fail_job(s, job_id=short, reason="a short reason stays whole")
        s.expire_all()
        assert dbj.get_job(s, short).error == "a short reason stays whole"


# ---- a name or label that prints as nothing is refused ----


@pytest.mark.parametrize("blank", ["\u200b\u200b\u200b", "   ", "\u00a0\u3000", "\ufeff \u200d", "\u2060"])
def test_a_job_name_that_prints_as_nothing_is_422_naming_the_field(
    api: Callable[..., TestClient], blank: str
) -> None:
    c = api()
    got = c.post("/api/jobs", json={**TINY_SPEC, "name": blank})
    assert got.status_code == 422, got.text
    detail = got.json()["detail"]
    assert detail.startswith("name: ") and "must hold a visible character" in detail, detail
    assert "Cf, Zs, Cc" in detail
    got = c.post(
        "/api/selections",
        json={"name": blank, "base": TINY_SPEC, "space": {"train.lr": [1e-3]}},
    )
    assert got.status_code == 422 and "must hold a visible character" in got.json()["detail"], got.text
    assert c.get("/api/jobs").json()["total"] == 0


def test_a_workspace_label_of_spaces_is_422_naming_the_field(api: Callable[..., TestClient]) -> None:
    c = api()
    for blank in ("   ", "\u200b"):
        got = c.post(
            "/api/workspaces",
            params={"name": blank},
            content=b"\x1f\x8b" + b"\0" * 30,
            headers={"Content-Type": "application/gzip"},
        )
        assert got.status_code == 422, got.text
        detail = got.json()["detail"]
        assert detail.startswith("name: ") and "must hold a visible character" in detail, detail
    assert c.get("/api/workspaces").json()["total"] == 0


def test_a_name_with_a_visible_character_among_invisible_ones_is_kept(api: Callable[..., TestClient]) -> None:
    got = api().post("/api/jobs", json={**TINY_SPEC, "name": "\u200bé run 1\u00a0"})
    assert got.status_code == 201, got.text
    assert got.json()["name"] == "\u200bé run 1\u00a0"


# ---- a selection batch holds so many trials ----


def _batch(**over: object) -> dict[str, object]:
    return {"name": "b", "base": TINY_SPEC, "space": {"train.lr": {"low": 1e-4, "high": 1e-2}}, **over}


def test_a_batch_over_the_trial_cap_is_refused_before_its_trials_are_checked(
    api: Callable[..., TestClient],
) -> None:
    c = api()  # the default cap, 1000
    got = c.post("/api/selections", json=_batch(method="random", trials=1024))
    assert got.status_code == 422, got.text
    assert got.json()["detail"] == (
        "trials: the batch would start with 1024 trials, 1024 in all; a selection batch holds at "
        "most 1000 trials (SHARDYARD_SELECTION_MAX_TRIALS): submit another batch for the rest"
    )
    grid = {"train.lr": [1e-3, 2e-3, 3e-3], "train.seed": list(range(4))}
    got = api(selection_max_trials=10).post("/api/selections", json=_batch(method="grid", space=grid))
    assert got.status_code == 422 and got.json()["detail"].startswith("space: the batch would start with 12")
    tpe = _batch(method="tpe", trials=11, space={"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}})
    got = api(selection_max_trials=10).post("/api/selections", json=tpe)
    assert got.status_code == 422 and got.json()["detail"].startswith("trials: "), got.text
    assert c.get("/api/selections").json()["total"] == 0


def test_adding_trials_past_the_cap_is_refused_with_the_numbers(api: Callable[..., TestClient]) -> None:
    c = api(selection_max_trials=6)
    sel = c.post("/api/selections", json=_batch(method="random", trials=4))
    assert sel.status_code == 201, sel.text
    sid = sel.json()["id"]
    assert c.post(f"/api/selections/{sid}/trials", json={"trials": 2}).status_code == 201
    got = c.post(f"/api/selections/{sid}/trials", json={"params": [{"train.lr": 1e-3}]})
    assert got.status_code == 422, got.text
    assert got.json()["detail"].startswith(
        "params: the batch has 6 trial(s) and this adds 1, 7 in all; a selection batch holds at most 6"
    )
    got = c.post(f"/api/selections/{sid}/trials", json={"trials": 3})
    assert got.status_code == 422 and got.json()["detail"].startswith("trials: the batch has 6"), got.text
    assert len(c.get(f"/api/selections/{sid}").json()["trials"]) == 6
    assert (
        api(selection_max_trials=0).post(f"/api/selections/{sid}/trials", json={"trials": 3}).status_code
        == 201
    )


# ---- `shardyard stack`: what to export, and a token that outlives a restart ----


def test_the_stack_keeps_its_admin_token_in_a_0600_file_under_its_root(tmp_path: Path) -> None:
    from api.stack import ADMIN_TOKEN_FILE, kept_admin_token

    root = tmp_path / "root"
    token = kept_admin_token(root)
    path = root / ADMIN_TOKEN_FILE
    assert token.startswith("sy_") and path.read_text().strip() == token
    assert path.stat().st_mode & 0o777 == 0o600
    assert kept_admin_token(root) == token  # a restart of the same root
    path.chmod(0o644)
    assert kept_admin_token(root) == token and path.stat().st_mode & 0o777 == 0o600
    assert kept_admin_token(tmp_path / "other") != token
    path.write_text("not a token\n")
    with pytest.raises(RuntimeError, match="delete it to make a new one"):
        kept_admin_token(root)


def test_the_stack_prints_the_url_to_export_beside_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make demo PORT=8411`: the CLI must go to port 8411, not its default 8000."""
    import api.stack
    from api.cli import main

    started: list[api.stack.Stack] = []

    class Started(api.stack.Stack):
        def start(self) -> api.stack.Stack:
            started.append(self)
            return self

        def supervise(self, **_: object) -> None:
            raise KeyboardInterrupt

        def stop(self) -> None:
            pass

    monkeypatch.setattr(api.stack, "Stack", Started)
    monkeypatch.setenv("COLUMNS", "60")  # a narrow terminal wraps nothing of the exports
    root = tmp_path / "root"
    for _ in range(2):
        assert main(["stack", "--root", str(root), "--port", "8411"]) == 0
    out = capsys.readouterr().out
    token = started[0].admin_token
    assert started[1].admin_token == token
    # a new user's first job runs beside the demo's: the worker runs several at once
    assert started[0].concurrency == 4
    # the dashboard opened by this machine's name is let in
    hosts = json.loads(started[0].extra_env["SHARDYARD_TRUSTED_HOSTS"])
    assert hosts[:2] == ["127.0.0.1", "localhost"] and socket.gethostname().lower() in hosts + ["localhost"]
    assert out.count("  export SHARDYARD_API_URL=http://127.0.0.1:8411\n") == 2
    assert out.count(f"  export SHARDYARD_TOKEN={token}\n") == 2
    assert out.count(f"\n{token}\n") == 2  # the bare token too, to paste into the sign-in


# ---- a refused Host says which, and what lets it in ----


def test_a_refused_host_is_named_with_the_setting_that_allows_it(api: Callable[..., TestClient]) -> None:
    c = api()
    got = c.get("/", headers={"Host": "devbox:8000"})
    assert got.status_code == 400 and got.headers["content-type"].startswith("text/plain")
    assert "host 'devbox' is not one this API answers to" in got.text
    assert 'SHARDYARD_TRUSTED_HOSTS is ["testserver"]' in got.text
    assert """SHARDYARD_TRUSTED_HOSTS='["testserver", "devbox"]'""" in got.text
    got = c.get("/api/jobs", headers={"Host": "evil.example"})
    assert got.status_code == 400 and "host 'evil.example'" in got.json()["detail"]
    assert got.headers["x-content-type-options"] == "nosniff"
    assert c.get("/api/health").status_code == 200  # testserver is listed
    ok = api(trusted_hosts=["testserver", "*.internal"]).get("/api/health", headers={"Host": "a.b.internal"})
    assert ok.status_code == 200


# ---- /docs renders without internet access ----


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_api_docs_load_every_asset_from_the_server_itself(
    api: Callable[..., TestClient], page: str
) -> None:
    c = api()
    got = c.get(page)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?://|//cdn|fonts\.googleapis", got.text), got.text
    urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", got.text)
    assert len(urls) >= 2, got.text  # the script and the favicon, at least
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), url  # same origin
        asset = c.get(url)
        assert asset.status_code == 200 and len(asset.content) > 1000, url
    assert c.get("/openapi.json").json()["openapi"].startswith("3.1")
    if page == "/docs":
        bundle = c.get("/docs-assets/swagger-ui-bundle.js").text
        assert re.search(r'"5\.\d+\.\d+"', bundle)  # Swagger UI 5: renders OpenAPI 3.1
