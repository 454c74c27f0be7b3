"""The FastAPI app factory."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from api.auth import bootstrap_admin
from api.limits import RequestLimits, clip
from api.routes import events, health, jobs, selections, users
from core.settings import Settings, get_settings

log = logging.getLogger(__name__)

_NO_DASHBOARD = """<!doctype html><title>Shardyard</title><h1>Shardyard</h1>
<p>The dashboard is not built. Run <code>make frontend</code> (or <code>make demo</code>).
The API is at <a href="/docs">/docs</a>.</p>"""


def _field(loc: tuple) -> str:
    parts = [clip(str(p), 64) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with one readable sentence per problem, each naming the field and the rule. The input
    itself is never echoed (it may be megabytes); at most 20 problems are listed."""
    errors = []
    for err in exc.errors()[:20]:
        msg = clip(err["msg"].removeprefix("Value error, "))
        errors.append({"field": _field(tuple(err["loc"])), "message": msg, "type": err["type"]})
    detail = clip("; ".join(f"{e['field']}: {e['message']}" for e in errors), 2000)
    return JSONResponse(status_code=422, content={"detail": detail, "errors": errors})


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Route errors, with any quoted input cut short."""
    detail = clip(exc.detail, 2000) if isinstance(exc.detail, str) else exc.detail
    return JSONResponse(status_code=exc.status_code, content={"detail": detail}, headers=exc.headers)


def _lifespan(settings: Settings):  # noqa: ANN202 - FastAPI's lifespan factory
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            bootstrap_admin(settings)
        except Exception:  # noqa: BLE001 - an unmigrated database must not stop the API serving 503s
            log.exception("could not set up the admin from SHARDYARD_ADMIN_TOKEN")
        yield

    return lifespan


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="Shardyard",
        version="0.1.0",
        description="Training orchestrator for models that do not fit.",
        lifespan=_lifespan(settings),
    )
    app.dependency_overrides[get_settings] = lambda: settings
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # the last added runs first: a foreign Host is refused before a body is read
    app.add_middleware(RequestLimits, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.trusted_hosts)
    app.include_router(users.router)
    app.include_router(health.router)
    app.include_router(events.router)
    app.include_router(jobs.router)
    app.include_router(selections.router)
    if (settings.frontend_dist / "index.html").exists():
        app.mount("/", StaticFiles(directory=settings.frontend_dist, html=True), name="dashboard")
    else:

        @app.get("/", include_in_schema=False)
        def no_dashboard() -> HTMLResponse:
            return HTMLResponse(_NO_DASHBOARD)

    return app
