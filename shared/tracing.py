"""OpenTelemetry traces: one trace per request across the gateway, the session manager and the
workers, carried over HTTP and in the job message's headers as a W3C `traceparent`.

Off unless `AXON_OTLP_ENDPOINT` is set: then `Tracing.start` returns None, no SDK provider
exists, and the hot path pays one `is None` check per span it would have made (`span`). On, spans
are head-sampled (`AXON_TRACE_SAMPLE_RATIO`, parent-based: a sampled caller's trace is always
kept) and exported over OTLP/HTTP by a batch processor on a thread of its own, from a bounded
queue: a slow or unreachable collector costs a request nothing, and the spans it loses are counted
(`axon_trace_spans_dropped_total`).

The providers are this module's objects, never OpenTelemetry's global ones: every service's app
holds its own `Tracing` on `app.state` (tests run several apps in one process).
"""

import contextlib
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, Span, SpanKind, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter

from shared.logging import get_logger
from shared.settings import CommonSettings

log = get_logger(__name__)

# The response header the gateway returns a request's trace id in (32 hex digits).
TRACE_ID_HEADER = "x-axon-trace-id"
TRACEPARENT = "traceparent"
# Job message header: when the session manager published the job (Unix time in nanoseconds), the
# start of the worker's `queued` span. Only with tracing on.
PUBLISHED_AT_HEADER = "x-axon-published-ns"

_PROPAGATOR = TraceContextTextMapPropagator()
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting the spans of batches it could not deliver, and how many spans
    are waiting in the processor's queue (`pending`) so that the processor can count those the
    full queue drops."""

    def __init__(self, exporter: SpanExporter, dropped: Counter) -> None:
        self._exporter = exporter
        self._dropped = dropped
        self.lock = threading.Lock()
        self.pending = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.lock:
            self.pending = max(0, self.pending - len(spans))
        result = self._exporter.export(spans)
        if result is not SpanExportResult.SUCCESS:
            self._dropped.labels("export_failed").inc(len(spans))
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class _BoundedBatchProcessor(BatchSpanProcessor):
    """`BatchSpanProcessor`, counting the spans its full queue drops."""

    def __init__(self, exporter: _CountingExporter, *, max_queue_size: int, dropped: Counter) -> None:
        super().__init__(exporter, max_queue_size=max_queue_size, max_export_batch_size=min(512, max_queue_size))
        self._counting = exporter
        self._max_queue_size = max_queue_size
        self._dropped_full = dropped.labels("queue_full")

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            with self._counting.lock:
                if self._counting.pending >= self._max_queue_size:
                    self._dropped_full.inc()  # the queue makes room by dropping its oldest span
                else:
                    self._counting.pending += 1
        super().on_end(span)


class Tracing:
    """A service's tracer, its exporter, and the propagation of its context."""

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self.tracer: Tracer = provider.get_tracer("axon")

    @classmethod
    def start(
        cls,
        *,
        endpoint: str,
        service: str,
        sample_ratio: float,
        max_queued_spans: int,
        export_timeout_s: float,
        registry: CollectorRegistry,
        instance_id: str | None = None,
    ) -> "Tracing | None":
        """The service's tracing, exporting to the OTLP/HTTP collector at `endpoint` (its base
        URL: spans go to `<endpoint>/v1/traces`); None (tracing off) when `endpoint` is empty.

        Args:
            service: the service's name (`axon-gateway`, `axon-sessions`, `axon-worker`).
            sample_ratio: the share of new traces kept (parent-based: a caller's decision stands).
            max_queued_spans: the export queue's bound; past it spans are dropped and counted.
            export_timeout_s: how long one export may take (on the exporter's thread).
            registry: where `axon_trace_spans_dropped_total` is registered.
            instance_id: `service.instance.id` (a worker's id).
        """
        if not endpoint:
            return None
        dropped = Counter(
            "axon_trace_spans_dropped_total",
            "Sampled spans never delivered to the trace collector, by reason (queue_full, export_failed).",
            ["reason"],
            registry=registry,
        )
        attributes: dict[str, str] = {"service.name": service}
        if instance_id:
            attributes["service.instance.id"] = instance_id
        provider = TracerProvider(
            resource=Resource.create(attributes),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        exporter = _CountingExporter(
            OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces", timeout=export_timeout_s), dropped
        )
        provider.add_span_processor(_BoundedBatchProcessor(exporter, max_queue_size=max_queued_spans, dropped=dropped))
        log.info("tracing_on", endpoint=endpoint, sample_ratio=sample_ratio)
        return cls(provider)

    @classmethod
    def of(
        cls, settings: CommonSettings, *, service: str, registry: CollectorRegistry, instance_id: str | None = None
    ) -> "Tracing | None":
        """`start` with the service's `AXON_OTLP_ENDPOINT`, `AXON_TRACE_*` settings."""
        return cls.start(
            endpoint=settings.otlp_endpoint,
            service=service,
            sample_ratio=settings.trace_sample_ratio,
            max_queued_spans=settings.trace_max_queued_spans,
            export_timeout_s=settings.trace_export_timeout_s,
            registry=registry,
            instance_id=instance_id,
        )

    def shutdown(self) -> None:
        """Export what is queued (within the export timeout) and stop the exporter's thread."""
        self._provider.shutdown()

    def server_span(self, name: str, headers: Sequence[tuple[bytes, bytes]]) -> contextlib.AbstractContextManager[Span]:
        """A request's span, current for the block: a child of the caller's valid `traceparent`
        header, else the root of a new trace (a malformed one is ignored). A caller's unsampled
        trace makes no span here: its context is current as it came (`_unsampled`)."""
        parent = None
        for key, value in headers:
            if key == b"traceparent":
                parent = _PROPAGATOR.extract({TRACEPARENT: value.decode("latin-1")})
                break
        caller = trace.get_current_span(parent)
        if _unsampled(caller):
            return trace.use_span(caller, end_on_exit=False)
        return self.tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER)

    def span(
        self,
        name: str,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        context: Context | None = None,
    ) -> contextlib.AbstractContextManager[Span | None]:
        """A child span of the current one (or of `context`), current for the block; none in an
        unsampled trace (`_unsampled`)."""
        return self._child(name, context=context, kind=kind, attributes=attributes)

    def _child(
        self,
        name: str,
        *,
        context: Context | None,
        kind: SpanKind,
        attributes: Mapping[str, Any] | None = None,
    ) -> contextlib.AbstractContextManager[Span | None]:
        parent = trace.get_current_span(context)
        if _unsampled(parent):  # current already, unless it came as `context`
            return _NO_SPAN if context is None else trace.use_span(parent, end_on_exit=False)
        return self.tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes)

    def record(
        self,
        name: str,
        *,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        context: Context | None = None,
    ) -> None:
        """A span that already happened (from `start_ns` to `end_ns`, Unix time in nanoseconds),
        a child of the current one (or of `context`); none in an unsampled trace."""
        if not _unsampled(trace.get_current_span(context)):
            self.tracer.start_span(name, context=context, attributes=attributes, start_time=start_ns).end(end_ns)

    @staticmethod
    def inject(carrier: MutableMapping[str, Any]) -> None:
        """Put the current span's `traceparent` (and `tracestate`) into `carrier`."""
        _PROPAGATOR.inject(carrier)

    @staticmethod
    def job_headers() -> dict[str, Any]:
        """What a job message carries for its worker's spans: the current `traceparent` and the
        time it is published (`PUBLISHED_AT_HEADER`)."""
        headers: dict[str, Any] = {PUBLISHED_AT_HEADER: time.time_ns()}
        _PROPAGATOR.inject(headers)
        return headers


def _unsampled(parent: Span) -> bool:
    """Whether `parent` belongs to a trace head sampling dropped. Its children would be dropped
    too (the sampler is parent-based), so none is made: the SDK makes even a dropped span at about
    the cost of a recorded one, and an unsampled request costs one span (its root, at the gateway)
    instead of one per step. Its context stays current, so its trace id still reaches the logs and
    the next hop."""
    context = parent.get_span_context()
    return context.is_valid and not context.trace_flags.sampled


def span(tracing: Tracing | None, name: str, **kwargs: Any) -> contextlib.AbstractContextManager[Span | None]:
    """`tracing.span(name, ...)`, or nothing at all when tracing is off."""
    if tracing is None:
        return _NO_SPAN
    return tracing.span(name, **kwargs)


def context_from(headers: Mapping[str, Any] | None) -> Context | None:
    """The trace context a message's `traceparent` header carries (str or bytes), or None."""
    if not headers:
        return None
    value = headers.get(TRACEPARENT)
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not isinstance(value, str):
        return None
    return _PROPAGATOR.extract({TRACEPARENT: value})


def remote_parent(traceparent: str | None) -> Context | None:
    """A context whose span is the (remote) one `traceparent` names, or None."""
    return _PROPAGATOR.extract({TRACEPARENT: traceparent}) if traceparent else None


def link_to(traceparent: str) -> Link | None:
    """A span link to the span a `traceparent` names, or None if it is malformed."""
    context = _PROPAGATOR.extract({TRACEPARENT: traceparent})
    span_context = trace.get_current_span(context).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def link_current_span(traceparent: str, *, why: str) -> None:
    """Link the current span (if it records) to the span `traceparent` names, saying `why`
    (`worker`: a job's span, from its final chunk; `stream start`: the request a resumed stream
    began with)."""
    current = trace.get_current_span()
    link = link_to(traceparent) if current.is_recording() else None
    if link is not None:
        current.add_link(link.context, {"axon.link": why})


def current_traceparent() -> str | None:
    """The current span's `traceparent`, or None outside any span (tracing off)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(TRACEPARENT)


def annotate(attributes: Mapping[str, Any], *, error: bool = False) -> None:
    """Set `attributes` on the current span (if it records), and mark it failed with `error`."""
    current = trace.get_current_span()
    current.set_attributes(attributes)
    if error:
        current.set_status(StatusCode.ERROR)


def trace_id_hex(span_: Span) -> str:
    """A span's trace id as 32 hex digits."""
    return format(span_.get_span_context().trace_id, "032x")


def exemplar() -> dict[str, str] | None:
    """An exemplar for a histogram observation: the current sampled span's trace and span ids, or
    None (outside any span, as always with tracing off, or in an unsampled trace)."""
    context = trace.get_current_span().get_span_context()
    if not context.trace_flags.sampled:
        return None
    return {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}


__all__ = [
    "PUBLISHED_AT_HEADER",
    "TRACEPARENT",
    "TRACE_ID_HEADER",
    "SpanKind",
    "StatusCode",
    "Tracing",
    "annotate",
    "context_from",
    "current_traceparent",
    "exemplar",
    "link_current_span",
    "link_to",
    "remote_parent",
    "span",
    "trace_id_hex",
]
