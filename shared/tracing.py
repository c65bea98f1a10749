"""OpenTelemetry tracing, opt-in by OpenTelemetry's own environment variables.

Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; then
each process exports its spans over OTLP, HTTP (`http/protobuf`, the default) or gRPC
(`OTEL_EXPORTER_OTLP_PROTOCOL=grpc`, or `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, which wins), sampled by `OTEL_TRACES_SAMPLER` (the SDK reads it), under
`OTEL_SERVICE_NAME` or the process's own name (streamq-api, streamq-worker).

A request's trace context rides in its queue entry (RequestPayload.trace, W3C `traceparent`), so
one trace holds the api's request span, the queue wait, the worker's spans and the relay to the
client, and a failover's continuation on another worker joins the same trace. Attributes follow
OpenTelemetry's GenAI conventions (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...).
Nothing is traced per token.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_enabled = False


def enabled() -> bool:
    return _enabled


def configure(service_name: str) -> bool:
    """Export this process's spans where OpenTelemetry's variables say; True if tracing is on."""
    global _enabled
    if _enabled or not any(os.environ.get(name) for name in _ENDPOINTS):
        return _enabled
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    traces, general = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"), os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    variable, protocol = (("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", traces) if traces  # the traces' own wins
                          else ("OTEL_EXPORTER_OTLP_PROTOCOL", general or "http/protobuf"))
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"{variable} is {protocol!r}; streamq exports traces over "
                         "'http/protobuf' or 'grpc'")
    # The given name only where OTEL_SERVICE_NAME does not name the service (it overrides the env).
    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(named))  # the sampler from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("tracing on: spans go over OTLP (%s) to %s", protocol,
             next(os.environ[name] for name in _ENDPOINTS if os.environ.get(name)))
    return True


def shutdown() -> None:
    """Export what is left (a process that ends flushes its last spans)."""
    provider = trace.get_tracer_provider()
    if _enabled and hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("streamq")


def inject(context: Context | None = None) -> dict[str, str] | None:
    """The current (or given) trace context as W3C headers, for a queue entry; None when off or unsampled."""
    if not _enabled:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier or None


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The context a queue entry's (or an HTTP request's) W3C headers carry."""
    return _PROPAGATOR.extract(dict(carrier or {}))


def ns(seconds: float) -> int:
    """A wall-clock time in seconds as OpenTelemetry's nanoseconds."""
    return int(seconds * 1e9)


def request_attributes(model: str, prompt_tokens: int, max_tokens: int | None) -> dict[str, Any]:
    """GenAI attributes of a request as it is queued."""
    out: dict[str, Any] = {"gen_ai.request.model": model, "gen_ai.usage.input_tokens": prompt_tokens}
    if max_tokens is not None:
        out["gen_ai.request.max_tokens"] = max_tokens
    return out
