"""A small OTLP trace receiver for the tests: it takes the real protocol (ExportTraceServiceRequest,
opentelemetry-proto's messages) over HTTP (POST /v1/traces, protobuf) or gRPC, and keeps every span."""
from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from shared.redis_server import free_port


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    """Spans as they arrive; `endpoint` and `protocol` go in OTEL_EXPORTER_OTLP_ENDPOINT/_PROTOCOL."""

    def __init__(self, protocol: str = "http/protobuf"):
        self.protocol = protocol
        self.port = free_port()
        self.spans: list[Span] = []
        self._lock = threading.Condition()
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(Span(attrs.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                                      s.parent_span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano,
                                      {a.key: _value(a.value) for a in s.attributes}, [e.name for e in s.events]))
        with self._lock:
            self.spans += spans
            self._lock.notify_all()

    def wait_for(self, condition, timeout_s: float = 60.0) -> list[Span]:
        """The spans once `condition(spans)` holds (re-checked as each export arrives)."""
        with self._lock:
            if not self._lock.wait_for(lambda: condition(list(self.spans)), timeout_s):
                raise AssertionError(f"no such spans within {timeout_s} s; got "
                                     f"{[(s.service, s.name, s.trace_id[:8]) for s in self.spans]}")
            return list(self.spans)

    def __enter__(self) -> Receiver:
        receiver = self
        if self.protocol == "grpc":
            class Service(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request, context):  # gRPC's method name
                    receiver.take(request)
                    return trace_service_pb2.ExportTraceServiceResponse()

            import grpc
            self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
            self._server.add_insecure_port(f"127.0.0.1:{self.port}")
            self._server.start()
            return self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # http.server's method name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self.protocol == "grpc":
            self._server.stop(0)
        else:
            self._server.shutdown()
            self._server.server_close()


def timeline_svg(spans: list[Span]) -> str:
    """One trace's spans as a timeline (SVG): a row each, children under their parent, bars on one
    time axis from the trace's first start to its last end, with each span's name and duration."""
    by_parent: dict[str, list[Span]] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        by_parent.setdefault(span.parent_id, []).append(span)
    ids = {s.span_id for s in spans}
    rows: list[tuple[int, Span]] = []

    def walk(span: Span, depth: int) -> None:
        rows.append((depth, span))
        for child in by_parent.get(span.span_id, []):
            walk(child, depth + 1)
    for root in [s for s in sorted(spans, key=lambda s: s.start_ns) if s.parent_id not in ids]:
        walk(root, 0)
    start, end = min(s.start_ns for s in spans), max(s.end_ns for s in spans)
    label_w, bar_w, row_h = 300, 640, 22
    scale = bar_w / max(1, end - start)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 80}" height="{row_h * len(rows) + 40}"'
           ' font-family="monospace" font-size="12">',
           f'<text x="4" y="14">one request, {len(rows)} spans, {(end - start) / 1e6:.1f} ms '
           '(tests/e2e/test_tracing.py)</text>']
    for i, (depth, span) in enumerate(rows):
        y = 24 + i * row_h
        x = label_w + (span.start_ns - start) * scale
        width = max(1.0, (span.end_ns - span.start_ns) * scale)
        colour = "#4c78a8" if span.service.endswith("api") else "#f58518"
        out.append(f'<text x="{4 + 12 * depth}" y="{y + 14}">{span.name} [{span.service}]</text>')
        out.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{width:.1f}" height="{row_h - 6}" fill="{colour}"/>')
        out.append(f'<text x="{x + width + 4:.1f}" y="{y + 14}">'
                   f'{(span.end_ns - span.start_ns) / 1e6:.1f} ms</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
