"""benchmarks/trace_picture.py: its OTLP/HTTP receiver takes what the OpenTelemetry SDK's exporter
sends (the services' exporter), and the waterfall draws every span of the trace under its parent."""

import xml.dom.minidom
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def picture() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports harness.py beside it
        import trace_picture

        yield trace_picture


def export(endpoint: str, service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=10)))
    return provider


def test_received_spans_keep_their_service_parent_and_status(picture: ModuleType) -> None:
    store = picture.SpanStore()
    server = picture.start_receiver(store)
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        gateway, worker = export(endpoint, "axon-gateway"), export(endpoint, "axon-worker")
        with gateway.get_tracer("t").start_as_current_span("POST /v1/chat/completions", kind=SpanKind.SERVER) as root:
            with gateway.get_tracer("t").start_as_current_span("authenticate"):
                pass
            with worker.get_tracer("t").start_as_current_span("job", kind=SpanKind.CONSUMER) as job:
                job.set_status(Status(StatusCode.ERROR, "engine failed"))
        gateway.shutdown()
        worker.shutdown()
        assert (
            httpx.post(
                f"{endpoint}/v1/logs", content=b"", headers={"content-type": "application/x-protobuf"}
            ).status_code
            == 404
        )
    finally:
        server.shutdown()

    trace_id = format(root.get_span_context().trace_id, "032x")
    spans = store.of_trace(trace_id)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"POST /v1/chat/completions", "authenticate", "job"}
    assert by_name["job"].service == "axon-worker" and by_name["authenticate"].service == "axon-gateway"
    assert by_name["job"].status == "error" and by_name["job"].kind == "consumer"
    root_id = by_name["POST /v1/chat/completions"].span_id
    assert by_name["job"].parent_id == by_name["authenticate"].parent_id == root_id
    order = [(s.name, depth) for s, depth in picture.tree_order(spans)]
    assert order == [("POST /v1/chat/completions", 0), ("authenticate", 1), ("job", 1)]

    svg = picture.waterfall_svg(spans, trace_id)
    document = xml.dom.minidom.parseString(svg)
    texts = [t.firstChild.data for t in document.getElementsByTagName("text") if t.firstChild]
    for span in spans:
        assert f"{span.service}: {span.name}" in texts
    bars = [r for r in document.getElementsByTagName("rect") if r.getAttribute("height") == "14"]
    assert len(bars) == len(spans)
    assert sum(1 for r in bars if r.getAttribute("stroke") == "#c4162a") == 1, "the failed span is outlined"
