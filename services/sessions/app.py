"""The session manager's app factory: middleware, routes and probes, and a lifespan that opens its
resources (`resources.py`) and puts its services on `app.state`."""

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.sessions.api import conversations as conversations_api
from services.sessions.api import responses as responses_api
from services.sessions.api import sessions as sessions_api
from services.sessions.api.routes import HOT_ROUTES, router
from services.sessions.metrics import SessionsMetrics
from services.sessions.resources import SessionsResources, open_resources
from services.sessions.response_runs import ResponseLeases
from services.sessions.responses_api import ResponsesService, ResponseStore
from services.sessions.service import CompletionService
from services.sessions.settings import SessionsSettings
from services.sessions.turns import Turns
from shared.hot_routes import HotRoutes
from shared.http_errors import install_error_handlers
from shared.internal_auth import InternalAuth
from shared.logging import get_logger
from shared.middleware import NO_FASTAPI_TELEMETRY, RequestContextMiddleware
from shared.names import Names
from shared.probes import PROBE_PATHS, install_probes
from shared.ratelimit import RateLimiter

log = get_logger(__name__)


async def _ready_reason(app: FastAPI) -> str | None:
    """Why this process cannot serve now, or None.

    PostgreSQL must have been reachable once (schema there, sessions creatable); after
    that an outage only delays persistence, so it does not take the process out of service.
    """
    connection = app.state.amqp
    if connection.is_closed or not connection.connected.is_set():
        return "RabbitMQ is not connected (reconnecting)"
    try:
        await asyncio.wait_for(app.state.redis.ping(), timeout=2)
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return f"Redis unreachable: {exc!r}"
    if not app.state.database_seen:
        try:
            await asyncio.wait_for(app.state.db.fetchval("SELECT 1"), timeout=2)
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            return f"PostgreSQL unreachable: {exc!r}"
        app.state.database_seen = True
    return None


async def _update_outbox_gauges(app: FastAPI, metrics: SessionsMetrics) -> None:
    """Outbox length and the age of its oldest entry (stream ids start with their ms timestamp)."""
    try:
        names: Names = app.state.names
        length = await app.state.redis.xlen(names.outbox)
        oldest = await app.state.redis.xrange(names.outbox, count=1) if length else []
    except Exception as exc:  # noqa: BLE001 - a scrape must not fail because Redis is down
        log.warning("outbox_gauges_failed", error=repr(exc))
        return
    metrics.outbox_length.set(length)
    age_s = time.time() - int(oldest[0][0].split(b"-")[0]) / 1000 if oldest else 0.0
    metrics.outbox_lag.set(max(0.0, age_s))


def _attach_services(
    app: FastAPI, opened: SessionsResources, *, settings: SessionsSettings, metrics: SessionsMetrics
) -> None:
    """Build the completion service on what is open and put it all on `app.state`, for the routes."""
    app.state.redis = opened.redis
    app.state.amqp = opened.amqp
    app.state.catalog = opened.catalog
    app.state.db = opened.db
    app.state.database_seen = False
    app.state.sessions = opened.store
    app.state.names = opened.names
    app.state.chunk_log = opened.chunk_log
    app.state.completions = CompletionService(
        settings=settings,
        catalog=opened.catalog,
        relay=opened.relay,
        publisher=opened.publisher,
        pipe=opened.pipe,
        outbox=opened.outbox,
        limiter=RateLimiter(opened.pipe, opened.names),
        turns=Turns(
            opened.store,
            instance_id=opened.instance_id,
            lock_ttl_s=settings.request_timeout_s + 30,
            gauge=metrics.active_sessions,
            affinity=opened.publisher.affinity,
        ),
        metrics=metrics,
        chunk_log=opened.chunk_log,
    )
    app.state.responses = ResponsesService(
        settings=settings,
        completions=app.state.completions,
        catalog=opened.catalog,
        sessions=opened.store,
        store=ResponseStore(
            opened.redis,
            opened.db,
            opened.outbox,
            namespace=settings.namespace,
            ttl_s=settings.response_ttl_s,
            pipe=opened.pipe,
        ),
        chunk_log=app.state.chunk_log,
        leases=ResponseLeases(
            opened.redis,
            namespace=settings.namespace,
            instance_id=opened.instance_id,
            lease_s=settings.response_lease_s,
            leased=metrics.responses_leased,
            taken_over=metrics.responses_taken_over,
        ),
    )


def create_app(settings: SessionsSettings | None = None) -> FastAPI:
    """Build the session manager app.

    Raises:
        InsecureConfiguration: no internal token, or a short one.
    """
    settings = settings or SessionsSettings()
    settings.require_internal_token()
    metrics = SessionsMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_resources(settings, metrics) as opened:
            _attach_services(app, opened, settings=settings, metrics=metrics)
            responses: ResponsesService = app.state.responses
            # Renews this process's leases on unfinished stored responses, takes over expired ones.
            sweeping = asyncio.create_task(responses.leases.run(responses.take_over))
            log.info("sessions_ready", port=settings.sessions_port, namespace=settings.namespace)
            try:
                yield
            finally:
                sweeping.cancel()
                await asyncio.gather(sweeping, return_exceptions=True)
                await responses.leases.stop()
                # With no request left, turns whose clients left may still be running: stored
                # complete if their answers end within the stop's grace (the deadline hook ends the rest).
                completions: CompletionService = app.state.completions
                await completions.detached_ended()

    app = FastAPI(
        title="Axon session manager",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        telemetry=NO_FASTAPI_TELEMETRY,
    )
    app.state.metrics = metrics
    app.state.request_limits = settings.request_limits
    install_error_handlers(app)
    app.add_middleware(HotRoutes, routes=HOT_ROUTES + responses_api.HOT_ROUTES)  # inside the two below
    app.add_middleware(InternalAuth, settings=settings)
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics.http,
        quiet_paths=PROBE_PATHS,
    )
    app.include_router(router)
    app.include_router(sessions_api.router)
    app.include_router(conversations_api.router)
    app.include_router(responses_api.router)

    install_probes(
        app,
        registry=metrics.registry,
        not_ready_reason=_ready_reason,
        ready_doc="Readiness: Redis and RabbitMQ are reachable.",
        before_scrape=lambda app: _update_outbox_gauges(app, metrics),
    )
    return app
