"""The jobs listing at scale: its counts and name searches read ix_jobs_listing (migration 0015)
rather than every job's row, and answer what a plain query over the rows would (newest first,
any case, a literal % or _), on SQLite and Postgres."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, insert

from db import jobs as dbj
from db.connection import get_engine, session_for
from db.models import Job
from db.users import create_user

NAMES = ["gpt-8l", "Llama-small", "mlp_probe", "gpt-2l", "50%-warmup"]


def _seed(url: str, n: int) -> list[dict[str, Any]]:
    with session_for(url) as s:
        users = [create_user(s, name=f"u{i}").id for i in range(3)]
        rows = [
            {
                "name": f"{NAMES[i % len(NAMES)]}-{i}" if i % 97 else f"rare-Needle-{i}",
                "kind": "job",
                "spec": {"train": {"steps": 1}},
                "status": ["queued", "succeeded", "failed"][i % 3],
                "owner_id": users[i % 3],
            }
            for i in range(n)
        ]
        s.execute(insert(Job), rows)
        s.commit()
        for i, job_id in enumerate(
            s.scalars(Job.__table__.select().with_only_columns(Job.id).order_by(Job.id))
        ):
            rows[i]["id"] = job_id
    return rows


def _expect(rows: list[dict[str, Any]], *, name: str | None = None, status: str | None = None) -> list[int]:
    hit = [
        r
        for r in rows
        if (name is None or name.lower() in r["name"].lower()) and status in (None, r["status"])
    ]
    return [r["id"] for r in sorted(hit, key=lambda r: -r["id"])]


def test_name_search_and_counts_answer_as_the_rows_do(db_url: str) -> None:
    rows = _seed(db_url, 600)
    with session_for(db_url) as s:
        for name, status in [
            ("GPT", None),
            ("needle", None),  # rare: 7 matches, spread from the oldest to the newest
            ("needle", "succeeded"),
            ("50%", None),  # a literal %, not a wildcard
            ("_probe", None),  # a literal _
            ("no-such", None),
            (None, "failed"),
            (None, None),
        ]:
            want = _expect(rows, name=name, status=status)
            for offset in (0, 3, len(want), len(want) + 5):
                got, total = dbj.list_jobs(s, name=name, status=status, limit=5, offset=offset)
                assert total == len(want), (name, status)
                assert [j.id for j in got] == want[offset : offset + 5], (name, status, offset)


def test_on_sqlite_counts_and_a_rare_search_read_the_index_not_the_table(tmp_path: Any) -> None:
    from db.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'plan.db'}"
    upgrade(url)
    _seed(url, 300)
    statements: list[tuple[str, Any]] = []
    engine = get_engine(url)

    def seen(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        statements.append((statement, params))

    event.listen(engine, "before_cursor_execute", seen)
    try:
        with session_for(url) as s:
            for kw in ({}, {"status": "failed"}, {"name": "needle"}):
                dbj.list_jobs(s, **kw)
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    raw = engine.raw_connection()
    try:
        plans = {
            sql: [row[-1] for row in raw.cursor().execute(f"EXPLAIN QUERY PLAN {sql}", params).fetchall()]
            for sql, params in statements
            if "FROM jobs" in sql and "users" not in sql.split("FROM jobs")[0]
        }
    finally:
        raw.close()
    counts = [p for sql, p in plans.items() if "count(" in sql]
    assert len(counts) == 3 and all(
        any("COVERING INDEX ix_jobs_listing" in step for step in p) for p in counts
    ), plans
    # no statement of the rare search walks the table row by row
    search = [p for sql, p in plans.items() if "LIKE" in sql]
    assert search and all("SCAN jobs" not in p for p in search), plans


def test_on_postgres_a_name_search_can_read_the_trigram_index(pg_server: str) -> None:
    """The listing's `name` filter is the expression ix_jobs_name_trgm indexes (migration 0017):
    with sequential scans priced out (a small table reads faster whole), its count reads the index."""
    from sqlalchemy import create_engine, func, select, text

    from db.migrate import upgrade

    admin = create_engine(pg_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text("DROP DATABASE IF EXISTS trgm"))
        c.execute(text("CREATE DATABASE trgm"))
    admin.dispose()
    url = pg_server.rsplit("/", 1)[0] + "/trgm"
    upgrade(url)
    _seed(url, 300)
    with session_for(url) as s:
        s.execute(text("SET enable_seqscan = off"))
        where = dbj.listing_filters(Job, owner_id=None, status=None, owner=None, name="Needle")
        q = select(func.count(Job.id)).where(*where)
        compiled = q.compile(s.get_bind())
        plan = "\n".join(r[0] for r in s.connection().exec_driver_sql(f"EXPLAIN {compiled}", compiled.params))
        assert "ix_jobs_name_trgm" in plan, plan
        assert s.scalar(q) == 4  # rare-Needle-0, -97, -194, -291
