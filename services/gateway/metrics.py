"""Prometheus metrics of one gateway process."""

from prometheus_client import CollectorRegistry, Counter

from shared.metrics import HttpMetrics


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = HttpMetrics(self.registry)
        self.auth_failures = Counter(
            "axon_gateway_auth_failures_total",
            "Requests refused for a missing, unknown or revoked key.",
            ["reason"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "axon_gateway_rate_limited_total",
            "Requests refused by a per-key limit.",
            ["kind"],
            registry=self.registry,
        )
        self.limiter_unavailable = Counter(
            "axon_gateway_rate_limiter_unavailable_total",
            "Requests the limiter could not check (Redis unreachable), by what happened to them.",
            ["mode"],
            registry=self.registry,
        )
        self.auth_fallbacks = Counter(
            "axon_gateway_auth_database_fallbacks_total",
            "Key lookups served by PostgreSQL because Redis was unreachable.",
            registry=self.registry,
        )
        self.overloaded = Counter(
            "axon_gateway_overloaded_total",
            "Requests refused at once because AXON_MAX_REQUESTS_IN_FLIGHT were being forwarded already.",
            registry=self.registry,
        )
