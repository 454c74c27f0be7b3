"""The REST service. Imports db/ and sends Celery tasks by name; never imports torch or trainer/."""
