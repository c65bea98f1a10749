"""The FastAPI application of one api replica. It never imports torch or loads weights."""
from __future__ import annotations

from contextlib import asynccontextmanager

from arq import create_pool
from fastapi import FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from shared.redis_client import arq_settings, connect

from api.auth import TenantDep, auth_enabled
from api.limits import Limits
from api.metrics import ApiMetrics, BodyLimit, CountRequests
from api.models import Models
from api.generation import ApiError
from api.hub import PubSubHub
from api.relay import Relay
from api.routes import batches, health, openai, playground, requests, seed
from shared import keys
from shared.apikeys import KeyStore
from shared.models import model_dir, served_name
from shared.settings import ApiSettings
from shared.store import RequestStore
from shared.tokenizer import Tokenizer


def create_app(settings: ApiSettings, tokenizer: Tokenizer | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = connect(settings.redis_url)
        hub = PubSubHub(redis, keys.replica_channel(settings.prefix, settings.replica), settings.sse_keepalive_s)
        await hub.start()
        store = RequestStore(redis, settings.prefix)
        app.state.settings = settings
        app.state.tokenizer = tokenizer or Tokenizer(model_dir(settings))
        app.state.model_name = served_name(settings)
        app.state.store = store
        app.state.hub = hub
        app.state.relay = Relay(store, hub)
        app.state.arq = await create_pool(arq_settings(settings.redis_url))
        app.state.keys = KeyStore(redis, settings.prefix) if auth_enabled(settings.auth, settings.host) else None
        limits = Limits(redis, settings.prefix, settings.queue_timeout_s + 3600) if app.state.keys is not None else None
        app.state.models = Models(store, app.state.relay, settings, limits)
        app.state.generation = await app.state.models.add(app.state.model_name, app.state.tokenizer)
        try:
            yield
        finally:
            await app.state.arq.aclose()
            await app.state.models.close()
            await hub.close()
            await redis.aclose()

    app = FastAPI(title="streamq", version="0.1.0", lifespan=lifespan)
    metrics = ApiMetrics()
    app.state.metrics = metrics
    app.add_middleware(CountRequests, metrics=metrics)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(_tenant: TenantDep):
        """Needs a key when keys are on, as every route but the health checks."""
        return metrics.response()

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.include_router(requests.router)
    app.include_router(openai.router)
    app.include_router(seed.router)
    app.include_router(batches.router)
    app.include_router(health.router)
    app.include_router(playground.router)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if request.url.path.startswith(openai.OPENAI_PATHS):
            status = 400 if exc.status == 422 else exc.status  # OpenAI answers every invalid request 400
            return JSONResponse(status_code=status, headers=exc.headers,
                                content=openai.openai_error(status, exc.message, exc.param, exc.code))
        return JSONResponse(status_code=exc.status, content={"detail": exc.message}, headers=exc.headers)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        message = f"the queue (Redis) is unavailable ({exc}); retry shortly"
        if request.url.path.startswith(openai.OPENAI_PATHS):
            return JSONResponse(status_code=503, headers={"Retry-After": "1"}, content=openai.openai_error(503, message))
        return JSONResponse(status_code=503, headers={"Retry-After": "1"}, content={"detail": message})

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path.startswith(openai.OPENAI_PATHS):
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(part) for part in first.get("loc", ()) if part != "body"]
            message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}"
                                for e in exc.errors())
            return JSONResponse(status_code=400, content=openai.openai_error(400, message, loc[0] if loc else None))
        return await request_validation_exception_handler(request, exc)

    return app
