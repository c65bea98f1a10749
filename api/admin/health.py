"""Liveness and readiness."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.admin.answers import Healthy, NotReady, Ready
from api.core.auth import SeesDetailsDep
from api.core.deps import ModelNameDep, StoreDep
from api.core.openapi import json_answer
from shared.workers import live_workers

router = APIRouter(tags=["health"])


@router.get("/healthz", responses=json_answer(Healthy, "The process is up."))
async def healthz():
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", responses={**json_answer(Ready, "Ready to serve."),
                                   **json_answer(NotReady, "Not ready, and why.", 503)})
async def readyz(store: StoreDep, model_name: ModelNameDep, details: SeesDetailsDep):
    """Ready when Redis answers and at least one live worker serves the model; 503 with the reason otherwise.
    The model and its workers (their hosts, plans) and Redis's error go to the operator only: the admin
    tenant's key, or with keys off a loopback Host; anyone else gets the status alone."""
    try:
        await store.redis.ping()
        workers = [w.wire() for w in await live_workers(store.redis, store.prefix) if w.model == model_name]
    except Exception as exc:  # noqa: BLE001 - any Redis failure means not ready
        reason = f"redis: {exc}" if details else "redis does not answer"
        return JSONResponse(status_code=503, content={"status": "unavailable", "reason": reason})
    if not workers:
        reason = f"no live worker serves {model_name}" if details else "no live worker serves the model"
        return JSONResponse(status_code=503, content={"status": "unavailable", "reason": reason})
    return {"status": "ready", "model": model_name, "workers": workers} if details else {"status": "ready"}
