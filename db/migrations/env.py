from __future__ import annotations

from alembic import context

from db.connection import get_engine
from db.models import Base

config = context.config


def run_migrations_online() -> None:
    engine = get_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
