"""Prometheus metrics of one api replica, served at /metrics; and the body-size guard.

Both middlewares are plain ASGI (not BaseHTTPMiddleware), so they add nothing per SSE chunk.

Each replica has its own registry (so several apps in one process, as in tests, never mix
counts). Names follow vLLM's style with the streamq: prefix.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared import redis_keys
from shared.workers import live_workers


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("streamq:api_requests", "HTTP requests answered, by route and status.",
                                ["endpoint", "method", "status"], registry=self.registry)
        self.open_streams = Gauge("streamq:api_open_streams", "SSE streams open on this replica.",
                                  registry=self.registry)
        # The same number on every replica (it is read from Redis): aggregate with max, not sum.
        self.queued = Gauge("streamq:num_requests_queued",
                            "Requests accepted for the model that no worker has taken yet, over all its lanes.",
                            ["model"], registry=self.registry)
        # Also read from Redis, at each scrape (sample_fleet): max over replicas too.
        self.workers_ready = Gauge("streamq:num_workers_ready",
                                   "Workers with a live heartbeat (what /readyz counts), by the model they serve.",
                                   ["model"], registry=self.registry)
        self.dead_letters = Gauge("streamq:dead_letter_requests",
                                  "Requests ever put in the dead-letter stream (its entries-added: it only grows).",
                                  registry=self.registry)
        self._models: set[str] = set()  # every model seen, so one whose workers all left reads 0, not nothing

    async def sample_fleet(self, redis: Redis, prefix: str, model: str) -> None:
        """The live workers of `model` (and of every model seen) and the dead letters, as Redis has
        them now, into their gauges."""
        live = [w.model for w in await live_workers(redis, prefix)]
        self._models.update([model, *filter(None, live)])
        for name in self._models:
            self.workers_ready.labels(name).set(live.count(name))
        try:
            added = (await redis.xinfo_stream(redis_keys.dead_letter_stream(prefix)))["entries-added"]
        except ResponseError:  # no such stream: nothing was ever dead-lettered
            added = 0
        self.dead_letters.set(added)

    def observe(self, scope: Scope, status: int) -> None:
        endpoint = getattr(scope.get("route"), "path", None) or "unmatched"
        self.requests.labels(endpoint, scope["method"], str(status)).inc()

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class CountRequests:
    """Counts every answered HTTP request by route template and status."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def noting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, noting)
        finally:
            self.metrics.observe(scope, status)


class BodyLimit:
    """413 for a body larger than `limit` bytes (411 without Content-Length), never passed on.

    The body is read and dropped before the answer: a client that does not wait for
    `100 Continue` (most do not) is still sending, and closing on it would reset the connection
    before it reads the 413. Chunks are discarded as they come; past `drain` bytes the
    connection is closed anyway, so a huge body costs bounded time and no memory.
    """

    def __init__(self, app: ASGIApp, limit: int, error: Callable[[str, int, str], Response],
                 drain: int = 64 * 2**20, paths: dict[str, int] | None = None):
        """`paths`: a limit of their own for these paths (a file upload's), instead of `limit`."""
        self.app, self.limit, self.error, self.drain = app, limit, error, drain
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            limit = self.paths.get(scope["path"], self.limit)
            refusal = None
            if length is not None and (not length.isdigit() or int(length) > limit):
                refusal = 413, (f"the request body is {length.decode(errors='replace')} bytes; "
                                f"the limit is {limit}")
            elif length is None and scope["method"] in ("POST", "PUT", "PATCH"):
                refusal = 411, "send a Content-Length header"
            if refusal is not None:
                await self._discard_body(receive)
                await self.error(scope["path"], *refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _discard_body(self, receive: Receive) -> None:
        seen = 0
        while seen <= self.drain:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
