"""Prometheus metrics of one worker, on its own port; names in vLLM's style (streamq: prefix).
Also the log line that ends each request, with its timings, and the worker's health checks
(`/livez`, `/readyz`) on the same port, for an orchestrator's probes.

Latencies are measured from the moment the api accepted the request (its `created_at`), so
time to first token and end-to-end latency include the time spent queued in Redis, as a
client sees them; queue time is accepted → taken by this worker.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from worker.engine.execution_plan import ExecutionPlan
from prometheus_client.exposition import CONTENT_TYPE_LATEST, ThreadingWSGIServer

from shared.messages import RequestPayload
from shared.queue import ANONYMOUS
from worker.engine.backend import Backend
from worker.engine.sequence import StepOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
log = logging.getLogger("worker.requests")
# A health check: None when healthy, else the reason it is not.
Check = Callable[[], str | None]


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("streamq:time_to_first_token_seconds", "Accepted by the api to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("streamq:inter_token_latency_seconds", "Between two tokens of one request.",
                             buckets=STEP_BUCKETS, registry=r)
        self.e2e = Histogram("streamq:e2e_request_latency_seconds", "Accepted by the api to finished.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("streamq:request_queue_time_seconds", "Accepted by the api to taken by a worker.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("streamq:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("streamq:num_requests_waiting", "Requests taken by this worker, not yet running.",
                             registry=r)
        self.batch_size = Histogram("streamq:step_batch_size", "Requests in one step (prefill chunks and decodes).",
                                    buckets=SIZE_BUCKETS, registry=r)
        self.step_time = Histogram("streamq:step_duration_seconds", "One engine step (schedule, forward, sample).",
                                   buckets=STEP_BUCKETS, registry=r)
        self.phases = Counter("streamq:step_phase_seconds",
                              "Seconds of the worker's steps by phase: arrivals, schedule, forward, sample (the "
                              "engine's, where it splits them) and publish (tokens to Redis).", ["phase"], registry=r)
        self.prompt_tokens = Counter("streamq:prompt_tokens", "Prompt tokens of requests taken.", registry=r)
        self.generation_tokens = Counter("streamq:generation_tokens", "Tokens generated.", registry=r)
        # The tenants are the operator's API keys' ("-" with auth off), so the label stays small.
        self.tenant_tokens = Counter("streamq:tenant_generation_tokens", "Tokens generated, by the request's tenant.",
                                     ["tenant"], registry=r)
        self.finished = Counter("streamq:request_success", "Requests ended, by finish reason.",
                                ["finished_reason"], registry=r)
        self.kv_used = Gauge("streamq:kv_cache_blocks_used", "KV-cache blocks held by requests or the prefix cache.",
                             registry=r)
        self.kv_free = Gauge("streamq:kv_cache_blocks_free", "KV-cache blocks free.", registry=r)
        self.plan = Gauge("streamq:worker_plan_info", "1, labelled with the paths this worker's engine takes "
                          "(worker/engine/execution_plan.py).", list(ExecutionPlan.__dataclass_fields__), registry=r)
        self.weight_bytes = Gauge("streamq:model_weight_bytes", "Bytes of weights a step reads, as held (quantized "
                                  "ones packed): absent where the engine does not count them.", registry=r)
        self.kv_usage = Gauge("streamq:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                              registry=r)
        self.prefix_queries = Counter("streamq:prefix_cache_queries", "Prompt blocks looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("streamq:prefix_cache_hits", "... and found there.", registry=r)
        self.preemptions = Counter("streamq:num_preemptions", "Requests preempted for lack of KV blocks.", registry=r)
        self.spec_drafts = Counter("streamq:spec_decode_num_drafts", "Decodes that carried proposed tokens.",
                                   registry=r)
        self.spec_proposed = Counter("streamq:spec_decode_num_draft_tokens", "Tokens proposed (speculative decoding).",
                                     registry=r)
        self.spec_accepted = Counter("streamq:spec_decode_num_accepted_tokens", "Proposed tokens the model kept.",
                                     registry=r)
        self.kv_tier = _tier_counters(r)
        self._last_token: dict[str, float] = {}  # request id -> when its last token was published
        self._first_token: dict[str, float] = {}  # request id -> when its first token was published
        self._tenant: dict[str, str] = {}  # request id -> its tenant, from taken to finished
        # Counts (worker/engine/backend.py) field -> its counter; the backend keeps running totals.
        self._totals = {"prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                        "preemptions": self.preemptions, "spec_drafts": self.spec_drafts,
                        "spec_proposed": self.spec_proposed, "spec_accepted": self.spec_accepted}
        self._seen: dict[str, float] = {}  # each running total last read, by its key in _advance

    def totals(self) -> dict[str, float]:
        """Running totals since this worker started, for its heartbeat: tokens generated, and the
        sum and count of its times to first token. Their growth between two beats is a rate that
        any reader of the heartbeats can compute for the whole cluster (the playground's charts)."""
        sample = self.registry.get_sample_value
        return {"generated_tokens": int(sample("streamq:generation_tokens_total") or 0),
                "ttft_sum_s": round(sample("streamq:time_to_first_token_seconds_sum") or 0.0, 6),
                "ttft_count": int(sample("streamq:time_to_first_token_seconds_count") or 0)}

    def serve(self, host: str, port: int, checks: dict[str, Check] | None = None) -> WSGIServer:
        """Start the HTTP server in a thread (its server_port is the port it bound): /metrics, and
        each of `checks` at its path, answering 200 or 503 with the reason as JSON."""
        app = _with_checks(_text_format(self.registry), checks or {})
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        server = make_server(host, port, app, server_class, handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, name="worker-metrics", daemon=True).start()
        return server

    def taken(self, payload: RequestPayload) -> None:
        self.queue_time.observe(max(0.0, time.time() - payload.created_at))
        self.prompt_tokens.inc(payload.num_prompt_tokens)
        self._tenant[payload.id] = payload.tenant or ANONYMOUS

    def step(self, outputs: list[StepOutput], duration_s: float, engine: Backend, worker: str = "") -> None:
        stamp = time.time()
        self.step_time.observe(duration_s)
        if scheduled := engine.last_step_size:
            self.batch_size.observe(scheduled)
        for out in outputs:
            rid = out.request_id
            if out.token is not None:
                self.generation_tokens.inc()
                self.tenant_tokens.labels(self._tenant.get(rid, ANONYMOUS)).inc()
                if out.token.index == 0:
                    self.ttft.observe(max(0.0, stamp - out.created_at))
                    self._first_token[rid] = stamp
                elif rid in self._last_token:
                    self.itl.observe(stamp - self._last_token[rid])
                self._last_token[rid] = stamp
            if out.finished:
                self._last_token.pop(rid, None)
                self._tenant.pop(rid, None)
                first = self._first_token.pop(rid, None)
                created, end = out.created_at, out.end
                self.e2e.observe(max(0.0, stamp - created))
                self.finished.labels(end.finish_reason.value).inc()
                log.info("request %s finished (%s, %d tokens)", rid, end.finish_reason.value,
                         end.completion_tokens, extra={
                             "request_id": rid, "worker": worker, "finish_reason": end.finish_reason.value,
                             "prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
                             "ttft_s": round(first - created, 4) if first else None,
                             "e2e_s": round(stamp - created, 4), "error": end.error})
        self.gauges(engine)

    def gauges(self, engine: Backend) -> None:
        """Batch and cache state, read from the engine after each step."""
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        if (kv := engine.kv_blocks()) is not None:
            free, total = kv
            self.kv_used.set(total - free)
            self.kv_free.set(free)
            self.kv_usage.set((total - free) / total)
        counts = engine.counts()
        for name, counter in self._totals.items():
            self._advance(counter, name, getattr(counts, name))
        if counts.kv_tier is not None:
            for name, total in asdict(counts.kv_tier).items():
                self._advance(self.kv_tier[name], f"kv_tier:{name}", total)
        for phase, total in engine.phase_seconds().items():
            self._advance(self.phases.labels(phase), f"phase:{phase}", total)

    def published(self, seconds: float) -> None:
        """A step's publish to Redis took `seconds`."""
        self.phases.labels("publish").inc(seconds)

    def _advance(self, counter, key: str, total: float) -> None:
        """A running total the engine keeps (its counts, its phase seconds), read under `key`,
        becomes the Prometheus `counter`: it grows by what the total grew since the last read."""
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[key] = total


# The shared KV tier's running totals (worker/engine/kv_tier.py TierCounts), where it is on.
_TIER_COUNTERS = (
    ("hits", "KV blocks fetched from the shared tier."),
    ("misses", "Tier lookups that ended at a block the tier did not have."),
    ("fetches", "Tier lookups (one per request whose prefix this worker's cache lacked)."),
    ("fetch_seconds", "Seconds the model thread spent fetching from the tier."),
    ("bytes_in", "Bytes of KV blocks fetched from the tier."),
    ("bytes_out", "Bytes of KV blocks offloaded to the tier."),
    ("offloaded", "KV blocks offloaded to the tier."),
    ("dropped", "KV blocks not offloaded: the tier's writer was behind, or Redis away."),
    ("errors", "Redis errors of the tier (each a miss or dropped blocks, never a failed request)."))


def _tier_counters(registry: CollectorRegistry) -> dict[str, Counter]:
    """streamq:kv_tier_<name> for each of the tier's totals, by name."""
    return {name: Counter(f"streamq:kv_tier_{name}", doc, registry=registry) for name, doc in _TIER_COUNTERS}


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # probes every few seconds: no access log
        pass


def _text_format(registry: CollectorRegistry):
    """The metrics in Prometheus's text format, whatever the scraper asks for, as the api's /metrics.
    Asked for OpenMetrics (Prometheus 2 asks first for it), prometheus_client writes `streamq:` as
    `streamq_` (OpenMetrics reserves colons), and the dashboard, the alerts and KEDA's query would
    find no worker metric."""
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
        return [generate_latest(registry)]
    return app


def _with_checks(metrics_app, checks: dict[str, Check]):
    """The WSGI app: a check's path answers its verdict; any other path, the metrics (as before)."""
    def app(environ, start_response):
        check = checks.get(environ.get("PATH_INFO", ""))
        if check is None:
            return metrics_app(environ, start_response)
        reason = check()
        status = "200 OK" if reason is None else "503 Service Unavailable"
        body = json.dumps({"status": "ok"} if reason is None else {"status": "unavailable", "reason": reason})
        start_response(status, [("Content-Type", "application/json"), ("Cache-Control", "no-store")])
        return [body.encode()]
    return app
