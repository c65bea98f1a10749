"""The playground: a chat page at `/` (static files, no build step) and the cluster view it polls."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, status
from fastapi.openapi.constants import REF_PREFIX
from fastapi.responses import FileResponse
from pydantic import WithJsonSchema

from api.core.auth import AdminDep
from api.admin.answers import Cluster
from api.core.deps import ModelNameDep, StoreDep
from api.core.openapi import json_answer
from shared.queue import RequestQueue
from shared.workers import live_workers

router = APIRouter()

STATIC = Path(__file__).resolve().parent.parent / "static"
# Served by name from this list only, so no path from a client ever reaches the file system.
ASSETS = {"playground.js": "text/javascript", "playground-tools.js": "text/javascript",
          "playground-responses.js": "text/javascript", "playground-charts.js": "text/javascript",
          "playground-images.js": "text/javascript",
          "playground.css": "text/css",
          # uPlot 1.6.32 (MIT), the charts' library, vendored from its npm package's dist/
          "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css"}
# The page loads nothing from elsewhere; the browser enforces it.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
                "Cache-Control": "no-cache"}


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "playground.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/static/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no static file {name!r}")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


# The view goes out as before (FastAPI's JSON of a dict); /openapi.json documents it as Cluster.
ClusterView = Annotated[dict, WithJsonSchema({"$ref": f"{REF_PREFIX}{Cluster.__name__}"})]


@router.get("/v1/cluster", tags=["cluster"], responses=json_answer(Cluster, "The live workers and the backlog."))
async def cluster(store: StoreDep, model_name: ModelNameDep, _admin: AdminDep) -> ClusterView:
    """The live workers (their heartbeats) and how many requests for the model wait for one.

    A heartbeat's running totals (generated_tokens, ttft_sum_s, ttft_count, read at `at`) grow
    by the worker's tokens and first tokens: the playground charts their rates. For the operator
    only (the admin tenant's key; with keys off, a loopback Host); the playground polls it every 2 s."""
    waiting, _taken = await RequestQueue(store.redis, store.prefix, model_name).backlog()
    workers = [w.wire() for w in await live_workers(store.redis, store.prefix)]
    return {"model": model_name, "workers": workers, "queue": {"waiting": waiting}}
