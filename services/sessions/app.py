"""The session manager's app factory: clients open in the lifespan and close in `finally`."""

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from shared.clients import connect_amqp, create_redis
from shared.logging import get_logger
from shared.names import Names
from shared.ratelimit import RateLimiter
from shared.registry import WorkerRegistry
from shared.web import ORJSONResponse, RequestContextMiddleware, install_error_handlers, metrics_response
from services.sessions.api.routes import router
from services.sessions.catalog import ModelCatalog
from services.sessions.jobs import JobPublisher
from services.sessions.metrics import SessionsMetrics
from services.sessions.relay import TokenRelay
from services.sessions.service import CompletionService
from services.sessions.settings import SessionsSettings

log = get_logger(__name__)


async def _ready_reason(app: FastAPI) -> str | None:
    """Why this process cannot serve now, or None."""
    connection = app.state.amqp
    if connection.is_closed:
        return "RabbitMQ connection is closed"
    try:
        await asyncio.wait_for(app.state.redis.ping(), timeout=2)
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return f"Redis unreachable: {exc!r}"
    return None


def create_app(settings: SessionsSettings | None = None) -> FastAPI:
    """Build the session manager app."""
    settings = settings or SessionsSettings()
    metrics = SessionsMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        names = Names(settings.namespace)
        client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
        subscriber = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s, for_pubsub=True)
        connection = await connect_amqp(settings.amqp_url, timeout_s=settings.connect_timeout_s)
        relay = TokenRelay(
            subscriber,
            home_channel=names.relay_channel(uuid.uuid4().hex),
            buffer_chunks=settings.stream_buffer_chunks,
            subscribe_timeout_s=settings.subscribe_timeout_s,
        )
        publisher = JobPublisher(
            connection,
            names,
            max_queued_jobs=settings.max_queued_jobs,
            publish_timeout_s=settings.publish_timeout_s,
        )
        try:
            await relay.start()
            await publisher.start()
            catalog = ModelCatalog(
                WorkerRegistry(client, names),
                aliases=settings.model_aliases,
                cache_ttl_s=settings.models_cache_ttl_s,
            )
            app.state.redis = client
            app.state.amqp = connection
            app.state.catalog = catalog
            app.state.completions = CompletionService(
                settings=settings,
                catalog=catalog,
                relay=relay,
                publisher=publisher,
                client=client,
                limiter=RateLimiter(client, names),
                metrics=metrics,
            )
            log.info("sessions_ready", port=settings.sessions_port, namespace=settings.namespace)
            yield
        finally:
            await relay.stop()
            with contextlib.suppress(Exception):
                await connection.close()
            await subscriber.aclose()
            await client.aclose()

    app = FastAPI(title="Axon session manager", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics.http,
        quiet_paths=frozenset({"/health", "/ready", "/metrics"}),
    )
    app.include_router(router)

    @app.get("/health")
    async def health() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Readiness: Redis and RabbitMQ are reachable."""
        reason = await _ready_reason(request.app)
        if reason is not None:
            return ORJSONResponse({"status": "not_ready", "reason": reason}, status_code=503)
        return ORJSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        """Prometheus metrics."""
        return metrics_response(metrics.registry)

    return app
