"""The glue: Celery tasks that claim jobs in the database, launch the trainer and relay its output."""
