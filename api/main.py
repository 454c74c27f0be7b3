"""The FastAPI app factory."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from api.routes import events, health, jobs, selections, workspaces
from core.settings import Settings, get_settings

_NO_DASHBOARD = """<!doctype html><title>Shardyard</title><h1>Shardyard</h1>
<p>The dashboard is not built. Run <code>make frontend</code> (or <code>make demo</code>).
The API is at <a href="/docs">/docs</a>.</p>"""


def _field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with one readable sentence per problem, each naming the field and the rule."""
    errors = []
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        errors.append({"field": _field(tuple(err["loc"])), "message": msg, "type": err["type"]})
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    return JSONResponse(status_code=422, content={"detail": detail, "errors": errors})


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="Shardyard", version="0.1.0", description="Training orchestrator for models that do not fit."
    )
    app.dependency_overrides[get_settings] = lambda: settings
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.include_router(health.router)
    app.include_router(events.router)
    app.include_router(jobs.router)
    app.include_router(selections.router)
    app.include_router(workspaces.router)
    if (settings.frontend_dist / "index.html").exists():
        app.mount("/", StaticFiles(directory=settings.frontend_dist, html=True), name="dashboard")
    else:

        @app.get("/", include_in_schema=False)
        def no_dashboard() -> HTMLResponse:
            return HTMLResponse(_NO_DASHBOARD)

    return app
