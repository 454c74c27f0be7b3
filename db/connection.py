"""The database connection set-up: one SQLAlchemy engine per process; SQLite or Postgres, the URL decides."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Engine, Result, Row, create_engine, event
from sqlalchemy.engine import CursorResult, make_url
from sqlalchemy.orm import Session, sessionmaker


def _sqlite_pragmas(dbapi_conn: Any, _record: object) -> None:  # a DB-API connection
    cur = dbapi_conn.cursor()
    # WAL lets the API read while a worker writes; busy_timeout waits out the short write locks
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


POOL_TIMEOUT_S = 10.0
"""Longest wait for a free pooled connection before the caller gets an error (the API: 503)."""
SQLITE_POOL_SIZE = 20
"""Connections to a SQLite file each process keeps open between sessions."""


@functools.cache
def get_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        pool: dict[str, int] = {}
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            # connections are kept for as many threads as the API runs at once (its requests' and
            # its streams'): past the default 5, each session opened a new connection (its pragmas,
            # SQLite reading the schema again) and closed it after, CPU the API spent under load,
            # when it has least (bench/api_load.py: 500 streams, 20 submits/s)
            pool = {"pool_size": SQLITE_POOL_SIZE, "max_overflow": 30}
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 10}, pool_timeout=POOL_TIMEOUT_S, **pool
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # bounded waits: a server that is gone fails a request in seconds instead of hanging it
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=10,
        max_overflow=20,
        pool_timeout=POOL_TIMEOUT_S,
        connect_args={"connect_timeout": 5},
    )


@functools.cache
def _factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


def session_for(url: str) -> Session:
    return _factory(url)()


AnyRow = Row[*tuple[Any, ...]]
"""A result row of any columns (a query's own shape: read by position or by name)."""


def rowcount(result: Result[*tuple[Any, ...]]) -> int:
    """The rows an UPDATE or DELETE matched. `Session.execute` types its answer as a Result; a
    statement's answer is a CursorResult, which counts them."""
    return cast("CursorResult[*tuple[Any, ...]]", result).rowcount
