"""Metrics every service exports: HTTP requests by route template, and the latency buckets the
services' histograms share."""

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import Scope

from shared.tracing import exemplar

# The methods a label names; any other a client sends is `other` (label values never grow without bound).
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Seconds; LLM requests run from milliseconds (errors, listings) to minutes (long answers).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class HttpMetrics:
    """Requests and their duration by route template (never raw paths: ids would explode cardinality)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "axon_http_requests_total",
            "HTTP requests answered.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "axon_http_request_duration_seconds",
            "From request to the end of the response body.",
            ["route", "method"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )

    def observe(self, scope: Scope, status: int, duration_s: float) -> None:
        route = scope.get("route")
        template = getattr(route, "path", "unmatched")
        method = scope["method"] if scope["method"] in _METHODS else "other"
        self.requests.labels(template, method, str(status)).inc()
        self.duration.labels(template, method).observe(duration_s, exemplar())
