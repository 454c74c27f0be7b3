"""Persistence: SQLAlchemy 2 tables, the engine, migrations and data functions. Imports SQLAlchemy only."""
