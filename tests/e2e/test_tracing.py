"""OpenTelemetry tracing through the real api, Redis and worker processes, checked by an OTLP
receiver that decodes the real protocol (streamq/testing/otlp_receiver.py): one request under a client's
traceparent is one trace, with the api's request span, the queue wait, the worker's spans and
the relay, linked as parent and child; a worker killed mid-request leaves the continuation's
span on the other worker in that same trace."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import pytest

from streamq.testing.otlp_receiver import Receiver, Span, timeline_svg
from tests.stack import Stack, kill_mid_stream

pytestmark = pytest.mark.timeout(300)

WORKER_SPANS = ("streamq.admission", "streamq.prefill", "streamq.decode", "streamq.publish")
FAST_FAILOVER = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1",
                 "STREAMQ_RECLAIM_INTERVAL_S": "1"}


def _env(receiver: Receiver) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": receiver.protocol,
            "OTEL_TRACES_SAMPLER": "always_on", "OTEL_BSP_SCHEDULE_DELAY": "100", **FAST_FAILOVER}


def _traceparent() -> tuple[str, str, str]:
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{parent}-01", trace_id, parent


def _one(spans: list[Span], name: str, **attributes) -> Span:
    found = [s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())]
    assert len(found) == 1, (name, attributes, [(s.name, s.attributes) for s in spans])
    return found[0]


@pytest.fixture(scope="module", params=["http/protobuf", "grpc"])
def traced(request, redis_url, tiny_llama, tmp_path_factory):
    with Receiver(request.param) as receiver, \
            Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("tracing"), workers=2, scheduler=True,
                  env=_env(receiver)) as stack:
        yield stack, receiver


def test_one_request_is_one_trace_from_the_api_through_redis_to_the_worker(traced):
    stack, receiver = traced
    header, trace_id, client_span = _traceparent()
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
            "temperature": 0, "ignore_eos": True, "stream": True}
    reply = httpx.post(f"{stack.urls[0]}/v1/chat/completions", json=body, headers={"traceparent": header},
                       timeout=120)
    assert reply.status_code == 200 and "[DONE]" in reply.text

    def complete(spans: list[Span]) -> bool:
        names = {s.name for s in spans if s.trace_id == trace_id}
        return {"POST /v1/chat/completions", "streamq.queue", "streamq.worker", "streamq.relay", *WORKER_SPANS} <= names
    spans = [s for s in receiver.wait_for(complete) if s.trace_id == trace_id]

    api = _one(spans, "POST /v1/chat/completions")
    queue, worker, relay = (_one(spans, name) for name in ("streamq.queue", "streamq.worker", "streamq.relay"))
    assert api.parent_id == client_span and api.service == "streamq-api"  # the caller's traceparent honoured
    assert queue.parent_id == worker.parent_id == relay.parent_id == api.span_id  # carried through Redis
    assert worker.service == "streamq-worker" and queue.service == "streamq-worker"
    phases = [_one(spans, name) for name in WORKER_SPANS]
    assert all(p.parent_id == worker.span_id for p in phases)
    # In order: accepted, queued, claimed, first step, first token, end, published; the relay ends
    # once the final event came, then the api's span (both may end before the worker's publish
    # call has returned to it, which ends the worker's spans).
    assert api.start_ns <= queue.start_ns <= queue.end_ns <= worker.start_ns
    assert [p.start_ns for p in phases] == sorted(p.start_ns for p in phases)
    assert phases[2].end_ns <= phases[3].start_ns <= relay.end_ns <= api.end_ns
    assert phases[3].end_ns <= worker.end_ns
    # GenAI attributes, and no span per token (20 tokens, 8 spans).
    assert api.attributes["gen_ai.request.model"] == stack.model_name
    assert api.attributes["gen_ai.request.max_tokens"] == 20 and api.attributes["gen_ai.usage.input_tokens"] > 0
    assert worker.attributes["gen_ai.usage.output_tokens"] == 20 == relay.attributes["gen_ai.usage.output_tokens"]
    assert worker.attributes["gen_ai.server.time_to_first_token"] > 0
    assert api.attributes["http.route"] == "/v1/chat/completions"
    assert len(spans) == 8
    if folder := os.environ.get("STREAMQ_ARTIFACTS"):  # the timeline docs/tracing.md shows
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"trace-timeline-{receiver.protocol.replace('/', '-')}.svg").write_text(timeline_svg(spans))


def test_a_failover_continuation_joins_the_same_trace(traced):
    stack, receiver = traced
    body = {"prompt": "Once", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    events, sent, _, victim = kill_mid_stream(stack, f"{stack.urls[0]}/v1/requests", body,
                                              headers=lambda: {"traceparent": _traceparent()[0]})
    assert events[-1]["data"]["finish_reason"] == "length"
    trace_id = sent["traceparent"].split("-")[1]

    def continued(spans: list[Span]) -> bool:  # the api's span ends after the relay's: wait for all three
        names = {s.name for s in spans if s.trace_id == trace_id}
        return {"streamq.worker", "streamq.relay", "POST /v1/requests"} <= names
    spans = [s for s in receiver.wait_for(continued) if s.trace_id == trace_id]
    worker = _one(spans, "streamq.worker")  # the victim's run never ended: only the continuation's is sent
    assert worker.attributes["streamq.worker"] != victim and worker.attributes["streamq.resumed_after"] >= 1
    api = _one(spans, "POST /v1/requests")
    assert worker.parent_id == api.span_id
