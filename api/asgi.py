"""ASGI entry point: `uvicorn api.asgi:app`."""

from api.main import create_app

app = create_app()
