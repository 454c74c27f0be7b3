"""The limit on failed token checks per client address (api/auth.py GuessLimit) and the compose
recipe's secrets: the sliding window, its bounded memory, and an admin token that reaches the API
as a secret file with Secure cookies."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import api.auth
from api.auth import GuessLimit, admin_secret
from core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_failures_past_the_limit_within_the_window_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(api.auth.time, "monotonic", lambda: now[0])
    g = GuessLimit(limit=3, window_s=60)
    assert [g.failed("a") for _ in range(3)] == [None, None, None]
    now[0] += 10
    assert g.failed("a") == 50  # the oldest of the last three is 10 s old
    assert g.failed("b") is None  # per address
    # a guesser that keeps on stays refused: each refused failure counts too
    for _ in range(20):
        now[0] += 10
        assert g.failed("a") == 40  # the oldest of the last three is 20 s old
    # more than a window since the oldest of the last three failures: heard again
    now[0] += 41
    assert g.failed("a") is None
    assert GuessLimit(limit=0, window_s=60).failed("a") is None  # 0: off


def test_the_addresses_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api.auth, "MAX_ADDRESSES", 100)
    g = GuessLimit(limit=1, window_s=60)
    for i in range(1000):
        g.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(g._failures) == 100
    assert g.failed("10.0.3.231") is not None  # the most recent are kept


def test_the_admin_token_is_read_from_its_file(tmp_path: Path) -> None:
    path = tmp_path / "admin_token"
    path.write_text("sy_from_a_file\n")
    assert admin_secret(Settings(admin_token_file=path)) == "sy_from_a_file"
    assert admin_secret(Settings()) is None
    path.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        admin_secret(Settings(admin_token_file=path))


def test_the_compose_recipe_keeps_the_admin_token_out_of_environments_and_cookies_secure() -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        assert "SHARDYARD_ADMIN_TOKEN" not in env, name
    api = compose["services"]["api"]
    assert api["environment"]["SHARDYARD_ADMIN_TOKEN_FILE"] == "/run/secrets/admin_token"
    assert api["secrets"] == ["admin_token"]
    assert compose["secrets"]["admin_token"] == {"environment": "SHARDYARD_ADMIN_TOKEN"}
    # Secure unless the operator turns it off (compose's default after :-)
    assert api["environment"]["SHARDYARD_COOKIE_SECURE"].endswith(":-true}")
