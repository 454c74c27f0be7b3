"""Steps that many migrations take, written once.

A revision that only adds columns to a table (and drops them again on the way down) says which
table and which columns; these functions do the batch alteration SQLite needs. They are part of
every revision that calls them, so their behaviour never changes: a new kind of step gets a new
function.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


def add_columns(table: str, *columns: sa.Column) -> None:
    """Add the columns to the table, in order."""
    with op.batch_alter_table(table) as batch_op:
        for column in columns:
            batch_op.add_column(column)


def drop_columns(table: str, *names: str) -> None:
    """Drop the named columns from the table, in order."""
    with op.batch_alter_table(table) as batch_op:
        for name in names:
            batch_op.drop_column(name)
