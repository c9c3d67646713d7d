"""One request through the real stack, its trace drawn as a waterfall (SVG), and its log lines.

    .venv/bin/python benchmarks/trace_picture.py                      # sim engine, docs/images/trace-waterfall.svg
    .venv/bin/python benchmarks/trace_picture.py --engine transformers --out /tmp/trace.svg

Starts an OTLP/HTTP receiver of its own (POST /v1/traces, protobuf, as the services' exporter
sends it), then a worker, a session manager and a gateway as processes with AXON_OTLP_ENDPOINT
pointing at it and AXON_TRACE_SAMPLE_RATIO 1, in a database and namespace of their own (removed at
the end). It sends one streamed chat completion, reads the trace id from the response's
`x-axon-trace-id` header, waits until that trace's spans stop arriving, and writes:

- the waterfall: one bar per span, in parent-then-start order, coloured by the service that sent
  it, on the request's time axis (what Grafana's trace view shows for the same trace in Tempo);
- the spans as JSON beside it (`.json`), as received;
- on stdout, a table of the spans and the log lines of the three services that carry the trace id.

Nothing is drawn from anything but the spans received from this run.
"""

import argparse
import gzip
import json
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import httpx
from harness import BenchEnvironment
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

ROOT = Path(__file__).resolve().parents[1]
SIM_MODEL = "sim-model"
ENGINES = {
    # A first token after 300 ms and 40 ms between tokens: long enough to see each hop's share.
    "sim": {"AXON_ENGINE": "sim", "AXON_MODEL": SIM_MODEL, "AXON_SIM_TTFT_MS": "300", "AXON_SIM_ITL_MS": "40"},
    "transformers": {"AXON_ENGINE": "transformers", "AXON_MODEL": "SmolLM2-135M-Instruct"},
}
SPAN_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass
class ReceivedSpan:
    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    status: str
    links: list[str]
    attributes: dict[str, Any]


def _value(any_value: Any) -> Any:
    field = any_value.WhichOneof("value")
    return getattr(any_value, field) if field and field not in ("array_value", "kvlist_value") else str(any_value)


class SpanStore:
    """The spans the receiver got, in arrival order, with the time the last one arrived."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.last_arrival = 0.0
        self._lock = threading.Lock()

    def add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", "?"))
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=s.name,
                            kind=SPAN_KINDS.get(s.kind, str(s.kind)),
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            status={0: "unset", 1: "ok", 2: "error"}.get(s.status.code, str(s.status.code)),
                            links=[link.trace_id.hex() for link in s.links],
                            attributes={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self._lock:
            self.spans.extend(received)
            self.last_arrival = time.monotonic()

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def start_receiver(store: SpanStore) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or "protobuf" not in self.headers.get("content-type", ""):
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            store.add(request)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def send_request(gateway_url: str, key: str, model: str) -> tuple[str, float]:
    """One streamed chat completion; (its trace id, seconds to the end of the stream)."""
    payload = {
        "model": model,
        "stream": True,
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "Name three rivers of Europe."}],
    }
    started = time.perf_counter()
    with (
        httpx.Client(timeout=120) as client,
        client.stream(
            "POST", f"{gateway_url}/v1/chat/completions", json=payload, headers={"authorization": f"Bearer {key}"}
        ) as response,
    ):
        if response.status_code != 200:
            raise SystemExit(f"the request failed: {response.status_code} {response.read().decode()}")
        trace_id = response.headers.get("x-axon-trace-id")
        for _ in response.iter_lines():
            pass
    if not trace_id:
        raise SystemExit("no x-axon-trace-id header: is tracing on in the services (AXON_OTLP_ENDPOINT)?")
    return trace_id, time.perf_counter() - started


def wait_for_trace(store: SpanStore, trace_id: str, quiet_s: float, timeout_s: float) -> list[ReceivedSpan]:
    """The trace's spans once its root span has arrived and no span arrived for `quiet_s`, counted
    from the call (the request's end: the exporters send a batch every few seconds)."""
    called = time.monotonic()
    deadline = called + timeout_s
    while time.monotonic() < deadline:
        spans = store.of_trace(trace_id)
        rooted = any(not s.parent_id for s in spans)
        if rooted and time.monotonic() - max(called, store.last_arrival) >= quiet_s:
            return spans
        time.sleep(0.2)
    spans = store.of_trace(trace_id)
    if not spans:
        raise SystemExit(f"no span of trace {trace_id} arrived within {timeout_s:.0f} s")
    print(f"the trace's root span did not arrive within {timeout_s:.0f} s: drawing what came", file=sys.stderr)
    return spans


def tree_order(spans: list[ReceivedSpan]) -> list[tuple[ReceivedSpan, int]]:
    """(span, depth): each span after its parent, siblings by start time; orphans (a parent not
    received) at the top level."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in spans:
        children[s.parent_id if s.parent_id in ids else ""].append(s)
    out: list[tuple[ReceivedSpan, int]] = []

    def visit(parent: str, depth: int) -> None:
        for child in sorted(children[parent], key=lambda s: (s.start_ns, -s.end_ns)):
            out.append((child, depth))
            visit(child.span_id, depth + 1)

    visit("", 0)
    return out


PALETTE = ["#3274d9", "#e0752d", "#37872d", "#8f3bb8", "#c4162a", "#1f9aa6"]


def waterfall_svg(spans: list[ReceivedSpan], trace_id: str) -> str:
    rows = tree_order(spans)
    t0 = min(s.start_ns for s in spans)
    total_ns = max(s.end_ns for s in spans) - t0 or 1
    services = sorted({s.service for s in spans})
    colour = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(services)}
    label_w, bar_w, row_h, top = 330, 560, 22, 70
    width = label_w + bar_w + 90
    height = top + row_h * len(rows) + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">Trace {trace_id}: '
        f"{len(spans)} spans, {total_ns / 1e6:.1f} ms</text>",
    ]
    x = 10
    for name in services:
        parts.append(f'<rect x="{x}" y="32" width="12" height="12" fill="{colour[name]}"/>')
        parts.append(f'<text x="{x + 16}" y="42">{escape(name)}</text>')
        x += 24 + 7 * len(name)
    # Time axis: five ticks.
    for i in range(6):
        tx = label_w + bar_w * i / 5
        parts.append(f'<line x1="{tx:.1f}" y1="{top - 8}" x2="{tx:.1f}" y2="{height - 30}" stroke="#dddddd"/>')
        tick = f"{total_ns * i / 5 / 1e6:.0f} ms"
        parts.append(f'<text x="{tx:.1f}" y="{top - 12}" text-anchor="middle" fill="#555555">{tick}</text>')
    for row, (span, depth) in enumerate(rows):
        y = top + row * row_h
        start = (span.start_ns - t0) / total_ns * bar_w
        length = max((span.end_ns - span.start_ns) / total_ns * bar_w, 1.5)
        label = f"{span.service}: {span.name}"
        parts.append(f'<text x="{10 + 12 * depth}" y="{y + 15}">{escape(label)}</text>')
        stroke = ' stroke="#c4162a" stroke-width="2"' if span.status == "error" else ""
        parts.append(
            f'<rect x="{label_w + start:.1f}" y="{y + 4}" width="{length:.1f}" height="{row_h - 8}" '
            f'fill="{colour[span.service]}"{stroke}/>'
        )
        parts.append(
            f'<text x="{label_w + start + length + 4:.1f}" y="{y + 15}" fill="#333333">'
            f"{(span.end_ns - span.start_ns) / 1e6:.1f} ms</text>"
        )
    parts.append(
        f'<text x="10" y="{height - 10}" fill="#555555">Drawn by benchmarks/trace_picture.py from the spans '
        "the services exported over OTLP/HTTP in one run.</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def trace_log_lines(log_dir: Path, trace_id: str) -> dict[str, list[dict]]:
    """The JSON log lines of each service that carry the trace id."""
    found: dict[str, list[dict]] = {}
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if trace_id not in line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("trace_id") == trace_id:
                found.setdefault(path.stem, []).append(record)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=sorted(ENGINES), default="sim")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "trace-waterfall.svg")
    parser.add_argument("--quiet-s", type=float, default=7.0, help="no new span for this long: the trace is complete")
    args = parser.parse_args()

    store = SpanStore()
    receiver = start_receiver(store)
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    tracing = {"AXON_OTLP_ENDPOINT": endpoint, "AXON_TRACE_SAMPLE_RATIO": "1", "AXON_LOG_FORMAT": "json"}
    worker_env = ENGINES[args.engine]
    try:
        with BenchEnvironment() as env:
            for kind in ("worker", "sessions", "gateway"):
                extra = dict(tracing)
                if kind == "worker":
                    extra |= worker_env
                    env.models.add(worker_env["AXON_MODEL"])
                if kind == "gateway":
                    extra["AXON_SESSIONS_URL"] = next(p.url for p in env.processes if p.name == "sessions")
                env.start_service(kind, env=extra)
            key = env.create_key()
            gateway_url = next(p.url for p in env.processes if p.name == "gateway")
            trace_id, elapsed = send_request(gateway_url, key, worker_env["AXON_MODEL"])
            print(f"request answered in {elapsed * 1000:.0f} ms, trace {trace_id}", file=sys.stderr)
            spans = wait_for_trace(store, trace_id, quiet_s=args.quiet_s, timeout_s=60)
            logs = trace_log_lines(env.log_dir, trace_id)
    finally:
        receiver.shutdown()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(waterfall_svg(spans, trace_id))
    args.out.with_suffix(".json").write_text(json.dumps([asdict(s) for s in spans], indent=1) + "\n")
    t0 = min(s.start_ns for s in spans)
    print(f"{'service':<10} {'span':<34} {'kind':<9} {'start ms':>9} {'ms':>9}  parent in trace")
    ids = {s.span_id for s in spans}
    for span, depth in tree_order(spans):
        name = "  " * depth + span.name
        parent = "yes" if span.parent_id in ids else "root" if not span.parent_id else "NO"
        print(
            f"{span.service:<10} {name[:34]:<34} {span.kind:<9} {(span.start_ns - t0) / 1e6:>9.1f} "
            f"{(span.end_ns - span.start_ns) / 1e6:>9.1f}  {parent}"
        )
    for service, records in logs.items():
        events = ", ".join(sorted({str(r.get("event")) for r in records}))
        print(f"log lines of {service} with trace_id {trace_id}: {len(records)} ({events})")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
