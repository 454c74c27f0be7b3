"""`alembic upgrade head` from code, so the API, the worker and `make` need no alembic.ini lookups."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

HERE = Path(__file__).resolve().parent


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


if __name__ == "__main__":
    import os
    import sys

    target = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.environ.get("SHARDYARD_DATABASE_URL", "sqlite:///.shardyard/shardyard.db")
    )
    upgrade(target)
    print(f"database at {target} is at the latest migration")
