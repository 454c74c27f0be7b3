"""The FastAPI app factory."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from kombu.exceptions import OperationalError as BrokerError
from pydantic import TypeAdapter
from redis.exceptions import RedisError
from sqlalchemy.exc import OperationalError as DbError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import metrics
from api.auth import GuessLimit, bootstrap_admin, credential_problem, forget_secret_variables
from api.docs_pages import add_docs_pages
from api.hosts import TrustedHosts
from api.limits import RequestLimits, clip
from api.metrics import LatencyMiddleware
from api.retention import retention_loop
from api.routes import events, health, jobs, queue, selections, users, webhooks, workspaces
from api.schemas import ValidationRefusal
from api.stalls import StallWatch
from api.streams import StreamSlots
from core.scheduler_proc import SchedulerProcess
from core.settings import Settings, get_settings
from core.storage import StorageError
from core.telemetry import process_exited
from db.connection import POOL_TIMEOUT_S, session_for
from db.selections import end_orphan_trial_jobs
from jobrules.spec import explain, problems

log = logging.getLogger(__name__)

_NO_DASHBOARD = """<!doctype html><title>Shardyard</title><h1>Shardyard</h1>
<p>The dashboard is not built. Run <code>make frontend</code> (or <code>make demo</code>).
The API is at <a href="/docs">/docs</a>.</p>"""


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with one readable sentence per problem, each naming the field and the rule: the same
    sentences `python -m trainer` exits 2 with (jobrules/spec.py formats both)."""
    return JSONResponse(
        status_code=422, content={"detail": explain(exc.errors()), "errors": problems(exc.errors())}
    )


def _unavailable(reason: str) -> JSONResponse:
    # Retry-After: these are passing conditions (a lock, a restart), not the client's fault
    return JSONResponse(status_code=503, content={"detail": reason}, headers={"Retry-After": "5"})


async def _database_error(_request: Request, exc: Exception) -> JSONResponse:
    """503 naming the reason: the database is locked by a writer past the busy timeout, or gone."""
    first = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:300]
    if "locked" in first or "busy" in first:
        return _unavailable(f"database is locked by another writer ({first}); retry shortly")
    log.warning("database unavailable: %s", first)
    return _unavailable(f"database unavailable: {first}")


async def _pool_exhausted(_request: Request, _exc: Exception) -> JSONResponse:
    return _unavailable(f"database busy: no free connection within {POOL_TIMEOUT_S:.0f}s; retry shortly")


async def _broker_error(_request: Request, exc: Exception) -> JSONResponse:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    log.warning("broker unavailable: %s", first)
    return _unavailable(f"broker unavailable: {first}")


async def _storage_error(_request: Request, exc: Exception) -> JSONResponse:
    log.warning("storage unavailable: %s", exc)
    return _unavailable(f"storage unavailable: {str(exc)[:500]}")


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Route errors, with any quoted input cut short."""
    detail = clip(exc.detail, 2000) if isinstance(exc.detail, str) else exc.detail
    return JSONResponse(status_code=exc.status_code, content={"detail": detail}, headers=exc.headers)


_REF = "#/components/schemas/"
_FASTAPI_422 = {"$ref": f"{_REF}HTTPValidationError"}


def declare_refusals(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI schema with the 422 that `_validation_error` really sends (ValidationRefusal)
    wherever FastAPI declared its own list of {loc, msg}: on every route with a parameter or a
    body, so a new route gets it too. FastAPI's two models leave the schema."""
    parts = TypeAdapter(ValidationRefusal).json_schema(mode="serialization", ref_template=_REF + "{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(parts.pop("$defs", {}))
    components[ValidationRefusal.__name__] = parts
    for operations in schema.get("paths", {}).values():
        for op in operations.values():
            answer = op.get("responses", {}).get("422")
            content = (answer or {}).get("content", {}).get("application/json", {})
            if content.get("schema") == _FASTAPI_422:
                answer["description"] = "Refused: each field named with the rule it breaks"
                content["schema"] = {"$ref": _REF + ValidationRefusal.__name__}
    for name in ("HTTPValidationError", "ValidationError"):  # the first refers to the second
        held = components.pop(name, None)
        if held is not None and f'"{_REF}{name}"' in json.dumps(schema):
            components[name] = held  # a route declares it itself
    return schema


def end_orphan_trials(settings: Settings) -> list[int]:
    """The start-up check: trial jobs that no trial points to can never run, yet they held the
    queue's depth and its oldest wait forever; they are ended (db/selections.py)."""
    with session_for(settings.database_url) as s:
        ids = end_orphan_trial_jobs(s)
    if ids:
        log.warning("ended %d trial job(s) that no trial points to (they could never run): %s", len(ids), ids)
    return ids


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    # the settings hold the admin token now; the processes this one starts need not inherit it
    forget_secret_variables()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            bootstrap_admin(settings)
        except Exception:  # noqa: BLE001 - an unmigrated database must not stop the API serving 503s
            log.exception("could not set up the admin from SHARDYARD_ADMIN_TOKEN")
        try:
            end_orphan_trials(settings)
        except Exception:  # noqa: BLE001 - as above: the API serves 503s rather than not start
            log.exception("could not check for trial jobs that no trial points to")
        cleanup = asyncio.create_task(retention_loop(settings)) if settings.job_retention_days > 0 else None
        # the scheduler ticks in a child process of every API process (core/scheduler_proc.py:
        # not a thread, which held the interpreter lock the requests need); one holds its lock
        sched = SchedulerProcess(settings).start() if settings.embedded_scheduler else None
        app.state.scheduler = sched
        beat = asyncio.create_task(stalls.start().beat()) if stalls is not None else None
        try:
            yield
        finally:
            if beat is not None:
                beat.cancel()
                stalls.stop()  # type: ignore[union-attr]
            if sched is not None:
                sched.stop()
            process_exited()
            if cleanup is not None:
                cleanup.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await cleanup

    stalls = StallWatch(settings.stall_log_s) if settings.stall_log_s > 0 else None
    app = FastAPI(
        title="Shardyard",
        version="0.1.0",
        description="Training orchestrator for models that do not fit.",
        lifespan=lifespan,
        docs_url=None,  # add_docs_pages: from this server's files, not a CDN
        redoc_url=None,
    )
    add_docs_pages(app, title=app.title)
    build_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = declare_refusals(build_openapi())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.stream_slots = StreamSlots(settings.sse_max_per_client)
    # failed token checks per client address, shared by the middleware's check and the routes'
    guesses = GuessLimit(limit=settings.auth_fail_limit, window_s=settings.auth_fail_window_s)
    app.state.guesses = guesses
    app.state.settings = settings  # api/deps.py app_settings
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # infrastructure faults answer 503 with the reason instead of 500
    app.add_exception_handler(DbError, _database_error)
    app.add_exception_handler(PoolTimeout, _pool_exhausted)
    app.add_exception_handler(RedisError, _broker_error)
    app.add_exception_handler(BrokerError, _broker_error)
    app.add_exception_handler(StorageError, _storage_error)
    # the last added runs first: a foreign Host is refused before a body is read; workspace
    # uploads are archives, bounded by their own limit (api/routes/workspaces.py); no body is
    # read before its caller is known, but a sign-in's (it carries the token)
    app.add_middleware(
        RequestLimits,
        max_body_bytes=settings.max_body_bytes,
        raw_paths=(r"^/api/workspaces/?$",),
        max_raw_bytes=int(settings.workspace_max_mb * 2**20),
        authenticate=functools.partial(credential_problem, settings, guesses=guesses),
        public_paths=(r"^/api/auth/session/?$",),
    )
    app.add_middleware(TrustedHosts, allowed_hosts=settings.trusted_hosts)
    # outermost: every answer is timed, the refusals of the two above included
    app.add_middleware(LatencyMiddleware, database_url=settings.database_url, stalls=stalls)
    app.include_router(users.router)
    app.include_router(health.router)
    app.include_router(events.router)
    app.include_router(jobs.router)
    app.include_router(queue.router)
    app.include_router(selections.router)
    app.include_router(workspaces.router)
    app.include_router(webhooks.router)
    app.include_router(metrics.router)
    if (settings.frontend_dist / "index.html").exists():
        app.mount("/", StaticFiles(directory=settings.frontend_dist, html=True), name="dashboard")
    else:

        @app.get("/", include_in_schema=False)
        def no_dashboard() -> HTMLResponse:
            return HTMLResponse(_NO_DASHBOARD)

    return app
