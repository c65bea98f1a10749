"""The worker's spans of each request it runs, in the trace its queue entry carries
(shared/tracing.py). All are made once the request's end is published, from times noted on the
way, so the per-token path costs nothing:

  streamq.queue      accepted by the api → claimed here (a first run only: a continuation's
                     request was queued long before)
  streamq.worker     claimed here → its end published; on a continuation after a failover,
                     `streamq.resumed_after` says how many tokens the dead worker had delivered
    streamq.admission  claimed → its first step began
    streamq.prefill    its first step began → its first token here
    streamq.decode     its first token here → its end
    streamq.publish    the publish of its end (the final event, the record, the ack)

Attributes follow OpenTelemetry's GenAI conventions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from shared import tracing
from shared.messages import RequestPayload
from worker.engine.sequence import StepOutput


@dataclass
class _Run:
    span: Span
    claimed: float
    created: float
    first_step: float | None = None
    first_token: float | None = None
    ended: float | None = None


class RequestSpans:
    def __init__(self, worker: str):
        self.worker = worker
        self.runs: dict[str, _Run] = {}  # request id -> its run here, until its end is published

    def taken(self, payload: RequestPayload, resumed: int) -> None:
        """Claimed here, with `resumed` tokens already delivered by a worker before."""
        if not tracing.enabled() or payload.trace is None:
            return
        claimed = time.time()
        parent = tracing.extract(payload.trace)
        ids = {"streamq.request_id": payload.id, "streamq.worker": self.worker}
        if resumed == 0:
            queue = tracing.tracer().start_span("streamq.queue", context=parent, kind=SpanKind.CONSUMER,
                                                start_time=tracing.ns(payload.created_at), attributes=ids)
            queue.end(end_time=tracing.ns(claimed))
        attributes = {**ids, **tracing.request_attributes(payload.model, payload.num_prompt_tokens,
                                                          payload.params.max_tokens),
                      "gen_ai.operation.name": "text_completion", "streamq.resumed_after": resumed}
        span = tracing.tracer().start_span("streamq.worker", context=parent, start_time=tracing.ns(claimed),
                                           attributes=attributes)
        self.runs[payload.id] = _Run(span, claimed, payload.created_at)

    def stepped(self, outputs: list[StepOutput]) -> None:
        """A step's outputs, before they are published: the first token's and the end's times."""
        if not self.runs:
            return
        stamp = time.time()
        for out in outputs:
            run = self.runs.get(out.request_id)
            if run is None:
                continue
            if out.token is not None and run.first_token is None:
                run.first_token, run.first_step = stamp, out.scheduled_at
            if out.finished:
                run.ended = stamp
                run.span.set_attributes({"gen_ai.usage.output_tokens": out.end.completion_tokens,
                                         "gen_ai.response.finish_reasons": [out.end.finish_reason.value]})
                if run.first_token is not None:
                    run.span.set_attribute("gen_ai.server.time_to_first_token", run.first_token - run.created)
                if out.end.error:
                    run.span.set_status(trace.Status(trace.StatusCode.ERROR, out.end.error))

    def published(self, outputs: list[StepOutput], started: float) -> None:
        """The step's outputs are in Redis (the publish began at `started`): the spans of the
        requests that ended in it are made and sent."""
        if not self.runs:
            return
        done = time.time()
        for out in outputs:
            if out.finished and (run := self.runs.pop(out.request_id, None)) is not None:
                self._children(run, started, done)
                run.span.end(end_time=tracing.ns(done))

    def _children(self, run: _Run, publish_started: float, published: float) -> None:
        parent = trace.set_span_in_context(run.span)
        first_step = run.first_step or run.first_token
        phases = [("streamq.admission", run.claimed, first_step), ("streamq.prefill", first_step, run.first_token),
                  ("streamq.decode", run.first_token, run.ended), ("streamq.publish", publish_started, published)]
        for name, start, end in phases:
            if start is not None and end is not None:
                span = tracing.tracer().start_span(name, context=parent, start_time=tracing.ns(start))
                span.end(end_time=tracing.ns(max(start, end)))
