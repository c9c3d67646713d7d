"""The session manager's app factory: clients open in the lifespan and close in `finally`."""

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import redis.asyncio as redis
from fastapi import FastAPI

from services.sessions.api import sessions as sessions_api
from services.sessions.api.routes import HOT_ROUTES, router
from services.sessions.catalog import ModelCatalog
from services.sessions.history import SessionStore
from services.sessions.jobs import JobPublisher
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox
from services.sessions.persister import Persister
from services.sessions.queue_depth import QueueDepthPoller
from services.sessions.relay import TokenRelay
from services.sessions.service import CompletionService
from services.sessions.settings import SessionsSettings
from services.sessions.turns import Turns
from shared.clients import connect_amqp, create_redis
from shared.hot_routes import HotRoutes
from shared.http_errors import install_error_handlers
from shared.logging import get_logger
from shared.middleware import NO_FASTAPI_TELEMETRY, RequestContextMiddleware
from shared.names import Names
from shared.probes import PROBE_PATHS, install_probes
from shared.ratelimit import RateLimiter
from shared.redis_pipe import RedisPipe
from shared.registry import WorkerRegistry

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


_ALIVE_TTL_S = 10
# How long shutdown waits for the persister to finish the batches it is committing.
_PERSISTER_STOP_S = 5
_ALIVE_EVERY_S = 3


async def _announce_alive(client: redis.Redis, key: str) -> None:
    """Keep this process's liveness key fresh; its session locks are honoured while it exists."""
    while True:
        try:
            await client.set(key, b"1", ex=_ALIVE_TTL_S)
        except Exception as exc:  # noqa: BLE001 - retried on the next beat
            log.warning("alive_beat_failed", error=repr(exc))
        await asyncio.sleep(_ALIVE_EVERY_S)


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


def create_app(settings: SessionsSettings | None = None) -> FastAPI:
    """Build the session manager app."""
    settings = settings or SessionsSettings()
    metrics = SessionsMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        names = Names(settings.namespace)
        client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
        # The hot path's commands (usage records, token charges, cancel notices), batched per loop iteration.
        pipe = RedisPipe(settings.redis_url, timeout_s=settings.connect_timeout_s)
        connection = await connect_amqp(settings.amqp_url, timeout_s=settings.connect_timeout_s)
        relay = TokenRelay(
            settings.redis_url,
            names,
            buffer_chunks=settings.stream_buffer_chunks,
            subscribe_timeout_s=settings.subscribe_timeout_s,
            spare_streams=settings.subscribe_ahead,
        )
        publisher = JobPublisher(
            connection,
            names,
            max_queued_jobs=settings.max_queued_jobs,
            publish_timeout_s=settings.publish_timeout_s,
        )
        # min_size=0: the session manager starts, and chats keep working, while PostgreSQL is down.
        db = await asyncpg.create_pool(
            settings.database_url,
            min_size=0,
            max_size=10,
            timeout=settings.connect_timeout_s,
            command_timeout=settings.connect_timeout_s * 2,
        )
        outbox = Outbox(client, names)
        store = SessionStore(
            client=client,
            db=db,
            names=names,
            outbox=outbox,
            metrics=metrics,
            history_max_messages=settings.history_max_messages,
            cache_ttl_s=settings.session_cache_ttl_s,
        )
        persister = Persister(
            client=client,
            db=db,
            names=names,
            metrics=metrics,
            batch_size=settings.persist_batch_size,
            flush_interval_ms=settings.persist_flush_interval_ms,
            reclaim_after_ms=settings.persist_reclaim_after_ms,
            concurrency=settings.persist_concurrency,
        )
        instance_id = uuid.uuid4().hex
        persisting = asyncio.create_task(persister.run())
        alive = asyncio.create_task(_announce_alive(client, names.sessions_instance(instance_id)))
        polling: asyncio.Task[None] | None = None
        try:
            await publisher.start()
            catalog = ModelCatalog(
                WorkerRegistry(client, names),
                cache_ttl_s=settings.models_cache_ttl_s,
            )
            poller = QueueDepthPoller(
                connection=connection, catalog=catalog, client=client, names=names, metrics=metrics
            )
            polling = asyncio.create_task(poller.run())
            app.state.redis = client
            app.state.amqp = connection
            app.state.catalog = catalog
            app.state.db = db
            app.state.database_seen = False
            app.state.sessions = store
            app.state.names = names
            app.state.completions = CompletionService(
                settings=settings,
                catalog=catalog,
                relay=relay,
                publisher=publisher,
                pipe=pipe,
                outbox=outbox,
                limiter=RateLimiter(pipe, names),
                turns=Turns(
                    store,
                    instance_id=instance_id,
                    lock_ttl_s=settings.request_timeout_s + 30,
                    gauge=metrics.active_sessions,
                ),
                metrics=metrics,
            )
            log.info("sessions_ready", port=settings.sessions_port, namespace=settings.namespace)
            yield
        finally:
            persister.stop()  # batches being committed finish; what is left stays pending, for a live persister
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(persisting), _PERSISTER_STOP_S)
            background = [t for t in (persisting, alive, polling) if t is not None]
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await relay.stop()
            with contextlib.suppress(Exception):
                await connection.close()
            await pipe.aclose()
            await client.aclose()
            await db.close()

    app = FastAPI(
        title="Axon session manager",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        telemetry=NO_FASTAPI_TELEMETRY,
    )
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(HotRoutes, routes=HOT_ROUTES)  # inside the request context below
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics.http,
        quiet_paths=PROBE_PATHS,
    )
    app.include_router(router)
    app.include_router(sessions_api.router)

    install_probes(
        app,
        registry=metrics.registry,
        not_ready_reason=_ready_reason,
        ready_doc="Readiness: Redis and RabbitMQ are reachable.",
        before_scrape=lambda app: _update_outbox_gauges(app, metrics),
    )
    return app
