"""Tokens and sessions in the data layer, against real SQLite and Postgres (migrated by Alembic):
what is made from a token dies with it, and sessions expire idle and absolutely."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from db import users as dbu
from db.connection import session_for
from db.models import ApiToken, utcnow


def _tok(s, user_id: int, name: str, **kw) -> ApiToken:  # noqa: ANN001
    return dbu.add_token(s, user_id=user_id, token_hash=name.ljust(64, "0"), prefix=name[:8], **kw)


def test_revoking_a_token_revokes_what_was_made_from_it(db_url: str) -> None:
    with session_for(db_url) as s:
        uid = dbu.create_user(s, name="u").id
        root = _tok(s, uid, "root")
        other = _tok(s, uid, "other")
        child = _tok(s, uid, "child", parent_id=root.id)
        grandchild = _tok(s, uid, "grand", kind="session", parent_id=child.id)
        sibling_session = _tok(s, uid, "osess", kind="session", parent_id=other.id)
        dbu.revoke_token(s, token_id=root.id)
        s.expire_all()
        for t in (root, child, grandchild):
            assert t.revoked_at is not None and dbu.why_dead(s, t) is not None
        assert other.revoked_at is None and sibling_session.revoked_at is None
        # a row made after its parent was revoked (the race with a sign-in) is dead by its chain
        late = _tok(s, uid, "late", kind="session", parent_id=child.id)
        assert late.revoked_at is None
        assert dbu.why_dead(s, late) == "the session's token was revoked"
        assert dbu.live_token(s, token_hash="late".ljust(64, "0"), kind="session") is None
        # the user's remaining token and session go together
        assert dbu.revoke_user_tokens(s, user_id=uid) == 3  # other, its session, late
        assert dbu.live_token(s, token_hash="other".ljust(64, "0"), kind="api") is None


def test_sessions_expire_idle_and_absolutely_and_use_is_recorded_sparingly(db_url: str) -> None:
    with session_for(db_url) as s:
        uid = dbu.create_user(s, name="u").id
        root = _tok(s, uid, "root")
        sess = _tok(
            s, uid, "sess", kind="session", parent_id=root.id, expires_at=utcnow() + timedelta(hours=1)
        )
        assert dbu.why_dead(s, sess, idle_s=60) is None
        # unused for two minutes: idle past 60 s, not past 300 s
        old = utcnow() - timedelta(seconds=120)
        s.execute(update(ApiToken).where(ApiToken.id == sess.id).values(last_used_at=old))
        s.commit()
        s.expire_all()
        assert "idle" in dbu.why_dead(s, sess, idle_s=60)
        assert dbu.why_dead(s, sess, idle_s=300) is None
        # a use within every_s of the last is not written; one after it is
        dbu.touch(s, sess, every_s=600)
        s.expire_all()
        assert abs((sess.last_used_at.replace(tzinfo=None) - old.replace(tzinfo=None)).total_seconds()) < 1
        dbu.touch(s, sess, every_s=60)
        s.expire_all()
        assert dbu.why_dead(s, sess, idle_s=60) is None
        # past its absolute expiry, however recently used
        s.execute(
            update(ApiToken).where(ApiToken.id == sess.id).values(expires_at=utcnow() - timedelta(seconds=1))
        )
        s.commit()
        s.expire_all()
        assert dbu.why_dead(s, sess, idle_s=60) == "the session has expired"
        # listed while live only; API tokens always
        kinds = [(t.kind, t.id) for t in dbu.list_tokens(s, user_id=uid)]
        assert kinds == [("api", root.id)]
