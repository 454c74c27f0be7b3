"""/api/health: database, broker and workers."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from api.deps import SessionDep, SettingsDep
from api.schemas import HealthPublic, WorkerPublic
from core.broker import redis_client
from db.connection import get_engine
from db.jobs import aware
from db.workers import live_workers

router = APIRouter(prefix="/api", tags=["health"])


@router.get("/health", response_model=HealthPublic)
def health(session: SessionDep, settings: SettingsDep) -> HealthPublic:
    pool = get_engine(settings.database_url).pool
    db = {"ok": True, "url": settings.database_url.split("@")[-1]}
    # pooled connections in use right now: open streams must not hold any while they wait
    if hasattr(pool, "checkedout"):
        db["pool"] = {"size": pool.size(), "checked_out": pool.checkedout()}
    try:
        session.execute(text("SELECT 1"))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        db = {"ok": False, "error": str(e), "pool": db.get("pool")}
    broker: dict = {"ok": True}
    try:
        redis_client(settings.broker_url).ping()
    except Exception as e:  # noqa: BLE001
        broker = {"ok": False, "error": str(e)}
    workers = live_workers(session, within_s=settings.worker_alive_s) if db["ok"] else []
    ok = db["ok"] and broker["ok"] and bool(workers)
    public = [
        WorkerPublic(
            name=w.name,
            hostname=w.hostname,
            queues=w.queues.get("queues", []),
            devices=w.devices.get("devices", []),
            host=w.devices.get("host") or {},
            last_seen=aware(w.last_seen),
            sandbox=(w.devices.get("sandbox") or {}).get("sandbox", "unknown"),
            sandbox_why=(w.devices.get("sandbox") or {}).get("why"),
        )
        for w in workers
    ]
    states = {w.sandbox for w in public}
    worst = next((s for s in ("off", "unavailable", "unknown", "on") if s in states), "unknown")
    return HealthPublic(
        status="ok" if ok else "degraded", db=db, broker=broker, workers=public, sandbox=worst
    )
