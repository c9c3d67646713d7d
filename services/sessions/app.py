"""The session manager's app factory: middleware, routes and probes, and a lifespan that opens its
resources (`resources.py`) and puts its services on `app.state`."""

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.sessions.batches import messages_router as message_batches_router
from services.sessions.batches import router as batches_router
from services.sessions.batches.admission import LineAdmission
from services.sessions.batches.service import BatchService
from services.sessions.batches.slack import QueueSlack
from services.sessions.batches.store import BatchStore
from services.sessions.chat import router as chat_router
from services.sessions.chat.service import ChatService
from services.sessions.completions import CompletionService
from services.sessions.conversations import router as conversations_router
from services.sessions.deps import SessionServices
from services.sessions.files import router as files_router
from services.sessions.leases import ResponseLeases
from services.sessions.messages import router as messages_router
from services.sessions.messages.service import MessagesService
from services.sessions.metrics import SessionsMetrics
from services.sessions.models import router as models_router
from services.sessions.prefix_routing import PrefixRouter
from services.sessions.resources import SessionsResources, open_resources
from services.sessions.responses import router as responses_router
from services.sessions.responses.service import ResponsesService
from services.sessions.responses.store import ResponseStore
from services.sessions.run_on import RunOn
from services.sessions.session_api import router as session_router
from services.sessions.settings import SessionsSettings
from services.sessions.turns import Turns
from shared.hot_routes import HotRoutes
from shared.http_errors import install_error_handlers
from shared.internal_auth import InternalAuth
from shared.keys import KeyRepository
from shared.logging import get_logger
from shared.middleware import NO_FASTAPI_TELEMETRY, RequestContextMiddleware
from shared.names import Names
from shared.prefix_index import PrefixIndex
from shared.probes import PROBE_PATHS, install_probes
from shared.ratelimit import RateLimiter
from shared.tracing import Tracing

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


async def _update_gauges(app: FastAPI, metrics: SessionsMetrics) -> None:
    """The gauges read at a scrape: the outbox's, and the batches' waiting lines."""
    await _update_outbox_gauges(app, metrics)
    try:
        await asyncio.wait_for(app.state.services.batches.export_gauges(), timeout=2)
    except Exception as exc:  # noqa: BLE001 - a scrape must not fail because PostgreSQL is down
        log.warning("batch_gauges_failed", error=repr(exc))


def _attach_services(
    app: FastAPI,
    opened: SessionsResources,
    *,
    settings: SessionsSettings,
    metrics: SessionsMetrics,
    tracing: Tracing | None,
) -> SessionServices:
    """Build the services on what is open; the probes' connections go on `app.state`, the routes'
    services in `app.state.services` (`deps.SessionServices`)."""
    app.state.redis = opened.redis
    app.state.amqp = opened.amqp
    app.state.db = opened.db
    app.state.database_seen = False
    app.state.names = opened.names
    completions = CompletionService(
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
        tracing=tracing,
        router=PrefixRouter(
            PrefixIndex(opened.pipe, opened.names),
            spill_seqs=settings.prefix_spill_seqs,
            lookup_timeout_s=settings.prefix_lookup_timeout_ms / 1000,
            routes=metrics.prefix_routes,
        )
        if settings.prefix_routing and opened.publisher.affinity
        else None,
    )
    run_on = RunOn(
        ResponseLeases(
            opened.redis,
            namespace=settings.namespace,
            instance_id=opened.instance_id,
            lease_s=settings.response_lease_s,
            leased=metrics.responses_leased,
            taken_over=metrics.responses_taken_over,
        )
    )
    responses = ResponsesService(
        settings=settings,
        completions=completions,
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
        chunk_log=opened.chunk_log,
        run_on=run_on,
        tracing=tracing,
    )
    chat = ChatService(completions=completions, run_on=run_on, chunk_log=opened.chunk_log, metrics=metrics)
    messages = MessagesService(completions=completions, limits=settings.request_limits, metrics=metrics)
    services = SessionServices(
        completions=completions,
        chat=chat,
        responses=responses,
        messages=messages,
        run_on=run_on,
        catalog=opened.catalog,
        sessions=opened.store,
        chunk_log=opened.chunk_log,
        metrics=metrics,
        request_limits=settings.request_limits,
        files=opened.files,
        batches=_batches(opened, settings=settings, metrics=metrics, chat=chat, responses=responses, messages=messages),
        file_max_bytes=settings.file_max_bytes,
        tracing=tracing,
    )
    app.state.services = services
    return services


def _batches(
    opened: SessionsResources,
    *,
    settings: SessionsSettings,
    metrics: SessionsMetrics,
    chat: ChatService,
    responses: ResponsesService,
    messages: MessagesService,
) -> BatchService:
    """The Batch API's service: its own leases (`<ns>:batches:*`) and its lines' admission."""
    return BatchService(
        settings=settings,
        store=BatchStore(opened.db, namespace=settings.namespace),
        files=opened.files,
        completions=responses.completions,
        chat=chat,
        responses=responses,
        messages=messages,
        admission=LineAdmission(
            keys=KeyRepository(opened.db),
            catalog=opened.catalog,
            limiter=RateLimiter(opened.pipe, opened.names),
            lease_s=settings.background_timeout_s,
            billing_factor=settings.batch_billing_factor,
        ),
        leases=ResponseLeases(
            opened.redis,
            namespace=settings.namespace,
            instance_id=opened.instance_id,
            lease_s=settings.response_lease_s,
            leased=metrics.batches_leased,
            taken_over=metrics.batches_taken_over,
            keys=(opened.names.batches_running, opened.names.batches_owners),
            kind="batch",
        ),
        slack=QueueSlack(opened.amqp, opened.names, ahead=settings.batch_queue_ahead, fair=settings.fair_share),
        catalog=opened.catalog,
        metrics=metrics,
    )


def create_app(settings: SessionsSettings | None = None) -> FastAPI:
    """Build the session manager app.

    Raises:
        InsecureConfiguration: no internal token, or a short one.
    """
    settings = settings or SessionsSettings()
    settings.require_internal_token()
    metrics = SessionsMetrics()
    tracing = Tracing.of(settings, service="axon-sessions", registry=metrics.registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with open_resources(settings, metrics) as opened:
                services = _attach_services(app, opened, settings=settings, metrics=metrics, tracing=tracing)
                # Renews this process's leases on unfinished stored responses, takes over expired ones.
                sweeping = asyncio.create_task(services.run_on.sweep(services.responses.take_over))
                # Runs the batches this process owns, takes over those whose owner died.
                batching = asyncio.create_task(services.batches.sweep())
                log.info("sessions_ready", port=settings.sessions_port, namespace=settings.namespace)
                try:
                    yield
                finally:
                    sweeping.cancel()
                    batching.cancel()
                    await asyncio.gather(sweeping, batching, return_exceptions=True)
                    # Stored responses and batches are handed over at once, side by side: stopping a
                    # batch's running lines (their jobs called off) never delays the responses'
                    # handover. Turns whose clients left may still be running: stored complete if
                    # they end within the stop's grace (`RunOn`).
                    await asyncio.gather(services.run_on.stop(), services.batches.leases.stop())
        finally:
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(
        title="Axon session manager",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        telemetry=NO_FASTAPI_TELEMETRY,
    )
    install_error_handlers(app)
    app.add_middleware(
        HotRoutes, routes=chat_router.HOT_ROUTES + responses_router.HOT_ROUTES + messages_router.HOT_ROUTES
    )  # inside the two below
    app.add_middleware(InternalAuth, settings=settings)
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics.http,
        quiet_paths=PROBE_PATHS,
        tracing=tracing,
    )
    app.include_router(models_router.router)
    app.include_router(chat_router.router)
    app.include_router(session_router.router)
    app.include_router(conversations_router.router)
    app.include_router(responses_router.router)
    app.include_router(files_router.router)
    app.include_router(batches_router.router)
    app.include_router(message_batches_router.router)

    install_probes(
        app,
        registry=metrics.registry,
        not_ready_reason=_ready_reason,
        ready_doc="Readiness: Redis and RabbitMQ are reachable.",
        before_scrape=lambda app: _update_gauges(app, metrics),
    )
    return app
