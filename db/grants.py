"""`python -m db.grants FILE`: run a SQL file of grants (docker/postgres/grants.sql) against
SHARDYARD_DATABASE_URL in one transaction, after the migrations. The compose deployment's `migrate`
service runs it as the tables' owner, so each process's role gets what it does on the tables of
this version (docs/security.md, "The broker"). A database other than PostgreSQL has no roles: then
it does nothing."""

from __future__ import annotations

import sys
from pathlib import Path

from sqlalchemy import create_engine


def apply_grants(url: str, sql: str) -> bool:
    """Run `sql` on `url` in one transaction; False (and nothing run) when it is not PostgreSQL."""
    engine = create_engine(url)
    try:
        if engine.dialect.name != "postgresql":
            return False
        with engine.begin() as cx:
            cx.exec_driver_sql(sql)
        return True
    finally:
        engine.dispose()


def main(argv: list[str]) -> int:
    from core.settings import get_settings

    if len(argv) != 1:
        print("usage: python -m db.grants FILE", file=sys.stderr)
        return 2
    url = get_settings().database_url
    done = apply_grants(url, Path(argv[0]).read_text())
    print(f"grants of {argv[0]} applied" if done else "not PostgreSQL: no roles, no grants")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
