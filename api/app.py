"""The FastAPI application of one api replica. It never imports torch or loads weights."""
from __future__ import annotations

import contextlib
import inspect
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError
from shared.arq_cluster import arq_pool
from shared.redis_client import REDIS_DOWN, connect, refuse_cluster

from api.core.auth import TenantDep, auth_enabled
from api.core.deps import Replica
from api.core.limits import Limits
from api.core.metrics import ApiMetrics, BodyLimit, CountRequests
from api.core.served_models import Models
from api.core.stream_slots import StreamSlots
from api.core.errors import ApiError
from api.core.grammar_pool import GrammarPool
from api.core.hosts import HostCheck, allowed_names
from api.core.hub import PubSubHub
from api.core.relay import Relay
from api.core.tracing import TraceRequests
from api.admin import health, lora, playground
from api.core.openapi import errors
from api.core.parsers import reasoning, registry
from api.anthropic import messages
from api.native import requests, seed
from api.openai import batches, chat, completions, files, models, tokenize
from api.openai.answers import OpenAIError
from api.openai.errors import OPENAI_PATHS, openai_error
from api.openai.pooling import routes as pooling
from api.openai.responses import routes as responses
from shared import redis_keys, tracing
from shared.api_keys import KeyStore
from shared.model_paths import model_dir
from shared.model_source import served_name
from shared.settings import ApiSettings
from shared.store import RequestStore
from shared.tokenizer import Tokenizer


# Paths whose errors take OpenAI's body (and 400 for every invalid request).
OPENAI_FAMILY = OPENAI_PATHS + responses.PATHS + pooling.PATHS + lora.PATHS + tokenize.PATHS


def create_app(settings: ApiSettings, tokenizer: Tokenizer | None = None,
               grammars: GrammarPool | None = None) -> FastAPI:
    """The app; `tokenizer` and `grammars` (its grammar pool) are built from the settings unless given."""
    registry.check(settings.tool_parser)  # a wrong name stops the replica here, not at its first model
    reasoning.check(settings.reasoning_parser)
    hosts = allowed_names(settings.allowed_hosts, settings.host)  # so does a Host name that can never match
    metrics = ApiMetrics()
    app = FastAPI(title="streamq", version="0.1.0", lifespan=_lifespan(settings, tokenizer, grammars, metrics),
                  **_no_native_telemetry())
    app.add_middleware(CountRequests, metrics=metrics)
    app.add_middleware(TraceRequests)  # around the routes and the counting: the request span holds it all

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request, _tenant: TenantDep):
        """Needs a key when keys are on, as every route but the health checks. The backlog, ready
        workers and dead letters are read from Redis now; with Redis away the last samples stay."""
        with contextlib.suppress(*REDIS_DOWN):
            replica = request.app.state.replica
            await replica.models.sample_backlogs()
            await metrics.sample_fleet(replica.store.redis, settings.prefix, replica.model_name)
        return metrics.response()

    for router in (requests.router, models.router, completions.router, chat.router, responses.router,
                   messages.router, pooling.router, tokenize.router, seed.router, batches.router, files.router, health.router,
                   playground.router):
        app.include_router(router)
    # The adapter routes answer errors in OpenAI's body (OPENAI_FAMILY), as vLLM's do.
    app.include_router(lora.router, responses=errors(OpenAIError, "OpenAI's error body."))
    # An upload to /v1/files may be as large as a file may be, with room for its multipart framing.
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, error=_error,
                       paths={"/v1/files": settings.files_max_bytes + 64 * 1024})
    app.add_middleware(HostCheck, names=hosts, error=_error)  # outermost: nothing runs for a refused Host
    _handle_errors(app)
    return app


def _no_native_telemetry() -> dict:
    """FastAPI 0.165 and later trace every request (and its dependencies) themselves once a tracer
    provider is set: api/core/tracing.py's span is the request's here, so theirs is turned off."""
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    return {}


def _lifespan(settings: ApiSettings, tokenizer: Tokenizer | None, grammars: GrammarPool | None, metrics: ApiMetrics):
    """The replica's connections and state (app.state.replica), from start to shutdown."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tracing.configure("streamq-api")
        redis = connect(settings.redis_url)
        with contextlib.suppress(*REDIS_DOWN):  # Redis away at start: the replica waits for it, as later
            await refuse_cluster(redis)
        hub = PubSubHub(redis, redis_keys.replica_channel(settings.prefix, settings.replica), settings.sse_keepalive_s)
        await hub.start()
        store = RequestStore(redis, settings.prefix)
        relay = Relay(store, hub, settings.relay_idle_s)
        arq = await arq_pool(settings.redis_url, redis_keys.arq_queue(settings.prefix))
        keys = KeyStore(redis, settings.prefix) if auth_enabled(settings.auth, settings.host) else None
        limits = (Limits(redis, settings.prefix, max(settings.queue_timeout_s, settings.flex_queue_timeout_s) + 3600)
                  if keys is not None else None)
        models = Models(store, relay, settings, limits, metrics, grammars)  # closes the pools with the models
        name, own_tokenizer = served_name(settings), tokenizer or Tokenizer(model_dir(settings))
        generation = await models.add(name, own_tokenizer)
        streams = StreamSlots(redis, settings.prefix, settings.max_streams_per_tenant, settings.stream_lease_s)
        app.state.replica = Replica(settings, store, hub, relay, arq, keys, models, name, own_tokenizer, generation,
                                    streams)
        try:
            yield
        finally:
            await streams.close()
            await arq.aclose()
            await models.close()
            await hub.close()
            await redis.aclose()
            tracing.shutdown()
    return lifespan


def _error(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the path's family's body: OpenAI's on the OpenAI paths, Anthropic's on the
    Messages paths, {"detail"} elsewhere."""
    if path.startswith(messages.PATHS):
        return JSONResponse(status_code=status, headers=headers, content=messages.anthropic_error(status, message))
    if path.startswith(OPENAI_FAMILY):
        return JSONResponse(status_code=status, headers=headers,
                            content=openai_error(status, message, param, code))
    return JSONResponse(status_code=status, content={"detail": message}, headers=headers)


def _handle_errors(app: FastAPI) -> None:
    """ApiError, Redis away (503) and invalid bodies, each in its path's family's body."""
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        openai_path = request.url.path.startswith(OPENAI_FAMILY + messages.PATHS)
        status = 400 if exc.status == 422 and openai_path else exc.status  # both answer every invalid request 400
        return _error(request.url.path, status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        message = f"the queue (Redis) is unavailable ({exc}); retry shortly"
        return _error(request.url.path, 503, message, headers={"Retry-After": "1"})

    @app.exception_handler(RedisOutOfMemoryError)
    async def redis_full(request: Request, exc: Exception) -> JSONResponse:
        # maxmemory with noeviction: Redis refuses new writes rather than lose queued work.
        message = "the server is full: the queue (Redis) reached its memory limit and takes no new requests; retry later"
        return _error(request.url.path, 503, message, code="overloaded", headers={"Retry-After": "5"})

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path.startswith(OPENAI_FAMILY + messages.PATHS):
            errors = exc.errors()
            loc = _field(errors[0]) if errors else []
            message = "; ".join(_openai_message(e) for e in errors)
            param = loc[0] if loc and errors[0].get("type") != "json_invalid" else None  # not a byte offset
            return _error(request.url.path, 400, message, param)
        return await request_validation_exception_handler(request, exc)


def _field(e: dict) -> list[str]:
    """Where a validation error is, without FastAPI's leading "body"."""
    loc = list(e.get("loc", ()))
    return [str(part) for part in (loc[1:] if loc[:1] == ["body"] else loc)]


def _openai_message(e: dict) -> str:
    loc = ".".join(_field(e))
    if e.get("type") == "extra_forbidden":  # OpenAI's own words for an argument it does not know
        return f"Unrecognized request argument supplied: {loc}"
    msg, error = e.get("msg") or "", str((e.get("ctx") or {}).get("error", ""))
    detail = f" ({error})" if error and error not in msg else ""  # a ValueError's message is in msg already
    return f"{loc}: {msg}{detail}" if loc else f"{msg}{detail}"
