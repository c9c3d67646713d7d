"""The probes every service answers: `/health` (the process answers), `/ready` (it can serve now, or
503 with the reason) and `/metrics` (Prometheus)."""

import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from shared.errors import Unauthorized
from shared.http_responses import ORJSONResponse

# Asked every few seconds by orchestrators and Prometheus: kept out of the access log.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


def install_probes(
    app: FastAPI,
    *,
    registry: CollectorRegistry,
    not_ready_reason: Callable[[FastAPI], Awaitable[str | None]],
    ready_doc: str,
    ready_fields: Callable[[FastAPI], Mapping[str, Any]] | None = None,
    before_scrape: Callable[[FastAPI], Awaitable[None]] | None = None,
    metrics_token: str | None = None,
) -> None:
    """Add `/health`, `/ready` and `/metrics` to `app`.

    Args:
        app: the service's app.
        registry: the metrics `/metrics` exports.
        not_ready_reason: why the service cannot serve now, or None (then `/ready` answers 200).
        ready_doc: what `/ready` checks, its OpenAPI description.
        ready_fields: more fields for the 200 body of `/ready`.
        before_scrape: run before each scrape, for gauges read only when asked for.
        metrics_token: `/metrics` answers only `Authorization: Bearer <it>` (compared in constant
            time); None: whoever reaches the port (a service behind `InternalAuth` is guarded there).
    """
    expected = f"Bearer {metrics_token}".encode() if metrics_token is not None else None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/ready", description=ready_doc)
    async def ready(request: Request) -> Response:
        reason = await not_ready_reason(request.app)
        if reason is not None:
            return ORJSONResponse({"status": "not_ready", "reason": reason}, status_code=503)
        return ORJSONResponse({"status": "ready", **(ready_fields(request.app) if ready_fields else {})})

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        """Prometheus metrics; in the OpenMetrics format, with the latency histograms' exemplars
        (trace ids), when the scraper accepts `application/openmetrics-text`."""
        if expected is not None and not hmac.compare_digest(
            request.headers.get("authorization", "").encode(), expected
        ):
            raise Unauthorized(
                "/metrics needs the internal token: Authorization: Bearer $AXON_INTERNAL_TOKEN.",
                code="invalid_internal_token",
                headers={"www-authenticate": 'Bearer realm="axon-internal"'},
            )
        if before_scrape is not None:
            await before_scrape(request.app)
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(registry), headers={"content-type": content_type})
