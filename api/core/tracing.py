"""The api's request span: one SERVER span per HTTP request, from its first byte to its last
(a stream's too), under the caller's W3C `traceparent` when it sends one. Requests queued while
it is current carry its context to the worker (api/core/generation.py), and the relay's span is its
child (api/core/relay.py). Only where tracing is on (shared/tracing.py); health checks, metrics,
the page and its cluster polls are not traced."""
from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared import tracing
from shared.messages import FinalEvent, TokenEvent

UNTRACED = ("/metrics", "/healthz", "/readyz", "/livez", "/v1/cluster", "/static/", "/docs", "/openapi.json")


class TraceRequests:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not tracing.enabled() or path == "/" or path.startswith(UNTRACED):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        span = tracing.tracer().start_span(f"{scope['method']} {path}", context=tracing.extract(headers),
                                           kind=SpanKind.SERVER,
                                           attributes={"http.request.method": scope["method"], "url.path": path})
        token = otel_context.attach(trace.set_span_in_context(span))

        async def noting(message: Message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)
        try:
            await self.app(scope, receive, noting)
        finally:
            if (route := getattr(scope.get("route"), "path", None)) is not None:
                span.update_name(f"{scope['method']} {route}")  # the template, not each request's id
                span.set_attribute("http.route", route)
            otel_context.detach(token)
            span.end()


class RelaySpan:
    """The relay of one request's events to its client, as a span under the request's: from the
    first read to the final event; its time to the first token, and the tokens relayed. No span
    (and no cost) where tracing is off."""

    def __init__(self, request_id: str):
        self.span = tracing.tracer().start_span("streamq.relay", attributes={"streamq.request_id": request_id}) \
            if tracing.enabled() else None
        self.tokens = 0

    def saw(self, event: object) -> None:
        if self.span is None:
            return
        if isinstance(event, TokenEvent):
            if self.tokens == 0:
                self.span.add_event("first token")
            self.tokens += 1
        elif isinstance(event, FinalEvent):
            self.span.set_attributes({"gen_ai.usage.output_tokens": event.usage.completion_tokens,
                                      "gen_ai.response.finish_reasons": [event.finish_reason.value],
                                      "streamq.relayed_tokens": self.tokens})

    def end(self) -> None:
        if self.span is not None:
            self.span.end()
