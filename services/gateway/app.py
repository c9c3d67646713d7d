"""The gateway's app factory: the public, OpenAI-compatible door."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry

from shared.logging import get_logger
from shared.web import ORJSONResponse, HttpMetrics, RequestContextMiddleware, install_error_handlers, metrics_response
from services.gateway.api.routes import router
from services.gateway.service import Forwarder
from services.gateway.settings import GatewaySettings

log = get_logger(__name__)


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """Build the gateway app."""
    settings = settings or GatewaySettings()
    registry = CollectorRegistry()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(settings.upstream_timeout_s, connect=settings.upstream_connect_timeout_s)
        limits = httpx.Limits(
            max_connections=settings.upstream_max_connections,
            max_keepalive_connections=settings.upstream_max_connections,
        )
        async with httpx.AsyncClient(base_url=settings.sessions_url, timeout=timeout, limits=limits) as client:
            app.state.upstream = client
            app.state.forwarder = Forwarder(client)
            log.info("gateway_ready", port=settings.gateway_port, sessions_url=settings.sessions_url)
            yield

    app = FastAPI(
        title="Axon",
        summary="OpenAI-compatible API for large language models.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.registry = registry
    install_error_handlers(app)
    app.add_middleware(
        RequestContextMiddleware,
        metrics=HttpMetrics(registry),
        quiet_paths=frozenset({"/health", "/ready", "/metrics"}),
    )
    app.include_router(router)

    @app.get("/health")
    async def health() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Readiness: the session manager is ready."""
        try:
            upstream = await request.app.state.upstream.get("/ready", timeout=3)
        except httpx.HTTPError as exc:
            return ORJSONResponse({"status": "not_ready", "reason": f"session manager unreachable: {exc!r}"}, status_code=503)
        if upstream.status_code != 200:
            return ORJSONResponse({"status": "not_ready", "reason": "session manager not ready"}, status_code=503)
        return ORJSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics."""
        return metrics_response(registry)

    return app
