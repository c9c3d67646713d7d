"""shared.tracing: off without an endpoint, a request span that honours a valid `traceparent` and
ignores a malformed one, spans lost to a full queue or a failed export counted, log lines that
carry the current span's ids."""

import json
import threading
from collections.abc import Iterator, Sequence

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from prometheus_client import CollectorRegistry, Counter

from shared.logging import configure_logging, get_logger
from shared.middleware import RequestContextMiddleware
from shared.settings import CommonSettings
from shared.tracing import (
    TRACE_ID_HEADER,
    Tracing,
    _BoundedBatchProcessor,
    _CountingExporter,
    context_from,
    exemplar,
    link_to,
    span,
)


@pytest.fixture
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exported: InMemorySpanExporter) -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return Tracing(provider)


def _app(tracing: Tracing | None) -> FastAPI:
    app = FastAPI()

    @app.get("/ok")
    async def ok() -> dict[str, str | None]:
        with span(tracing, "inner"):
            found = exemplar()
            get_logger("test").info("handled")
        return {"trace_id": found["trace_id"] if found else None}

    app.add_middleware(RequestContextMiddleware, tracing=tracing)
    return app


async def _get(app: FastAPI, headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.get("/ok", headers=headers)


def test_no_endpoint_no_tracing() -> None:
    assert CommonSettings().otlp_endpoint == ""
    assert Tracing.of(CommonSettings(), service="axon-test", registry=CollectorRegistry()) is None
    with span(None, "anything") as nothing:
        assert nothing is None


async def test_untraced_requests_get_no_trace_header() -> None:
    response = await _get(_app(None), {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"})
    assert TRACE_ID_HEADER not in response.headers
    assert response.json() == {"trace_id": None}


async def test_a_valid_traceparent_is_the_request_spans_parent(
    tracing: Tracing, exported: InMemorySpanExporter
) -> None:
    response = await _get(_app(tracing), {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"})
    assert response.headers[TRACE_ID_HEADER] == "a" * 32
    assert response.json() == {"trace_id": "a" * 32}  # the histogram exemplar of a sampled span
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert set(spans) == {"inner", "GET /ok"}
    request = spans["GET /ok"]
    assert request.parent is not None and format(request.parent.span_id, "016x") == "b" * 16
    assert spans["inner"].parent is not None and spans["inner"].parent.span_id == request.context.span_id


@pytest.mark.parametrize(
    "malformed",
    [f"00-{'a' * 32}-{'z' * 16}-01", f"00-{'0' * 32}-{'b' * 16}-01", "00-abc", "", f"ff-{'a' * 32}-{'b' * 16}-01"],
)
async def test_a_malformed_traceparent_starts_a_new_trace(
    tracing: Tracing, exported: InMemorySpanExporter, malformed: str
) -> None:
    response = await _get(_app(tracing), {"traceparent": malformed})
    assert response.status_code == 200
    trace_id = response.headers[TRACE_ID_HEADER]
    assert len(trace_id) == 32 and trace_id not in {"a" * 32, "0" * 32}
    request = next(s for s in exported.get_finished_spans() if s.name == "GET /ok")
    assert request.parent is None


async def test_an_unsampled_callers_trace_makes_no_span_but_keeps_its_id(
    tracing: Tracing, exported: InMemorySpanExporter, logs: pytest.CaptureFixture[str]
) -> None:
    configure_logging(service="test", traced=True)
    response = await _get(_app(tracing), {"traceparent": f"00-{'a' * 32}-{'b' * 16}-00"})
    assert response.headers[TRACE_ID_HEADER] == "a" * 32
    assert response.json() == {"trace_id": None}  # no exemplar from an unsampled trace
    assert exported.get_finished_spans() == ()
    (handled,) = [line for line in _lines(logs) if line["event"] == "handled"]
    assert (handled["trace_id"], handled["span_id"]) == ("a" * 32, "b" * 16)


def test_spans_of_an_unsampled_root_are_not_made(exported: InMemorySpanExporter) -> None:
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0)))
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracing = Tracing(provider)
    with tracing.server_span("GET", []) as root:
        assert root.get_span_context().is_valid and not root.is_recording()
        with span(tracing, "child") as child:
            assert child is None
        tracing.record("done", start_ns=1, end_ns=2)
    assert exported.get_finished_spans() == ()


def test_message_headers_and_links_read_a_traceparent_or_nothing() -> None:
    traceparent = f"00-{'c' * 32}-{'d' * 16}-01"
    assert context_from({"traceparent": traceparent.encode()}) is not None
    assert context_from({}) is None and context_from(None) is None and context_from({"traceparent": 7}) is None
    link = link_to(traceparent)
    assert link is not None and format(link.context.span_id, "016x") == "d" * 16
    assert link_to("nonsense") is None


class _Stuck(SpanExporter):
    """An exporter that holds its first batch until released, then fails every export."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(10)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.set()


def _dropped(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("axon_trace_spans_dropped_total", {"reason": reason}) or 0.0


def test_tracing_starts_with_an_endpoint_and_counts_drops_on_its_registry() -> None:
    registry = CollectorRegistry()
    tracing = Tracing.start(
        endpoint="http://127.0.0.1:9",
        service="axon-test",
        sample_ratio=1.0,
        max_queued_spans=8,
        export_timeout_s=1,
        registry=registry,
    )
    assert tracing is not None
    tracing.shutdown()
    assert "axon_trace_spans_dropped" in registry._names_to_collectors


def test_spans_lost_to_a_full_queue_or_a_failed_export_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")  # the exporter's thread takes the first span at once
    registry = CollectorRegistry()
    dropped = Counter("axon_trace_spans_dropped_total", "Dropped.", ["reason"], registry=registry)
    stuck = _Stuck()
    provider = TracerProvider()
    provider.add_span_processor(
        _BoundedBatchProcessor(_CountingExporter(stuck, dropped), max_queue_size=4, dropped=dropped)
    )
    tracer = provider.get_tracer("test")
    tracer.start_span("first").end()
    assert stuck.entered.wait(5)  # the exporter's thread holds the first span
    for i in range(10):  # four fit in the queue; six are dropped
        tracer.start_span(f"span-{i}").end()
    assert _dropped(registry, "queue_full") == 6
    stuck.release.set()
    provider.shutdown()
    assert _dropped(registry, "export_failed") == 5  # the first and the four queued


@pytest.fixture
def logs(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    capsys.readouterr()
    yield capsys
    configure_logging(service="test")


def _lines(logs: pytest.CaptureFixture[str]) -> list[dict]:
    return [json.loads(line) for line in logs.readouterr().err.splitlines()]


def test_log_lines_in_a_span_carry_its_ids_when_tracing_is_on(
    tracing: Tracing, logs: pytest.CaptureFixture[str]
) -> None:
    configure_logging(service="test", traced=True)
    log = get_logger("test")
    log.info("outside")
    with tracing.span("work") as current:
        log.info("inside")
    outside, inside = _lines(logs)
    context = current.get_span_context()
    assert inside["trace_id"] == format(context.trace_id, "032x")
    assert inside["span_id"] == format(context.span_id, "016x")
    assert "trace_id" not in outside


def test_log_lines_carry_no_trace_ids_when_tracing_is_off(tracing: Tracing, logs: pytest.CaptureFixture[str]) -> None:
    configure_logging(service="test")
    with tracing.span("work"):
        get_logger("test").info("inside")
    (inside,) = _lines(logs)
    assert inside["event"] == "inside" and "trace_id" not in inside
