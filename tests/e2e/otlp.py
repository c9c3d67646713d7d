"""An OTLP/HTTP trace receiver for tests: a small HTTP server on a thread that decodes each
`POST /v1/traces` (an `ExportTraceServiceRequest` protobuf) and keeps its spans."""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    # (trace id, span id) of each linked span.
    links: tuple[tuple[str, str], ...] = ()


def _value(value: AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


class OtlpReceiver:
    """Listens on 127.0.0.1 (a free port); `endpoint` is what `AXON_OTLP_ENDPOINT` takes."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes}
                            | {f"resource.{k}": v for k, v in resource.items()},
                            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        )
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(
        self, trace_id: str, done: Callable[[list[ReceivedSpan]], bool], *, timeout_s: float = 30
    ) -> list[ReceivedSpan]:
        """The trace's spans once `done(spans)` holds; fails after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if done(spans):
                return spans
            assert time.monotonic() < deadline, (
                f"trace {trace_id} incomplete: {sorted((s.service, s.name) for s in spans)}"
            )
            time.sleep(0.2)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
