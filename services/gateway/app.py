"""The gateway's app factory: the public, OpenAI-compatible door."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import orjson
from fastapi import FastAPI

from services.gateway import playground
from services.gateway.admission import Admitter
from services.gateway.api import admin, routes
from services.gateway.auth import Authenticator
from services.gateway.metrics import GatewayMetrics
from services.gateway.service import Forwarder, GatewayService, InFlightLimit
from services.gateway.settings import GatewaySettings
from shared.clients import create_redis
from shared.hot_routes import HotRoutes
from shared.http1 import Http1Client, RemoteProtocolError
from shared.http_errors import install_error_handlers
from shared.keys import KeyRepository
from shared.logging import get_logger
from shared.middleware import NO_FASTAPI_TELEMETRY, RequestContextMiddleware
from shared.names import Names
from shared.probes import PROBE_PATHS, install_probes
from shared.ratelimit import RateLimiter
from shared.redis_pipe import RedisPipe

log = get_logger(__name__)


UPSTREAM_KEEPALIVE_S = 2.0
_SESSIONS_READY_TIMEOUT_S = 3.0


class InsecureConfiguration(RuntimeError):
    """The gateway refuses to start with this configuration."""


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """Build the gateway app.

    Raises:
        InsecureConfiguration: no admin token, or a short or well-known one.
    """
    settings = settings or GatewaySettings()
    problem = settings.admin_token_problem()
    if problem is not None:
        raise InsecureConfiguration(f"Refusing to start the admin API: {problem}.")
    metrics = GatewayMetrics()
    names = Names(settings.namespace)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Idle upstream connections are dropped before the session manager's keep-alive
        # timeout, so the gateway never reuses one the other side is closing.
        upstream = Http1Client(
            settings.sessions_url,
            max_idle_connections=settings.max_requests_in_flight,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            read_timeout_s=settings.upstream_timeout_s,
            idle_timeout_s=UPSTREAM_KEEPALIVE_S,
        )
        client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
        # The hot path's commands (rate-limit checks and releases), batched per loop iteration.
        pipe = RedisPipe(settings.redis_url, timeout_s=settings.connect_timeout_s)
        # min_size=0: the gateway starts (and serves cached keys) even while PostgreSQL is down.
        db = await asyncpg.create_pool(
            settings.database_url,
            min_size=0,
            max_size=10,
            timeout=settings.connect_timeout_s,
            command_timeout=settings.connect_timeout_s,
        )
        keys = KeyRepository(db)
        try:
            app.state.upstream = upstream
            app.state.redis = client
            app.state.db = db
            app.state.keys = keys
            app.state.names = names
            app.state.authenticator = Authenticator(
                repository=keys,
                client=client,
                names=names,
                metrics=metrics,
                local_ttl_s=settings.key_cache_local_ttl_s,
                redis_ttl_s=settings.key_cache_ttl_s,
            )
            admitter = Admitter(
                limiter=RateLimiter(pipe, names),
                metrics=metrics,
                fail_open=settings.rate_limit_fail_open,
                lease_s=settings.concurrency_lease_s,
            )
            app.state.gateway = GatewayService(
                forwarder=Forwarder(upstream),
                authenticator=app.state.authenticator,
                admitter=admitter,
                in_flight=InFlightLimit(settings.max_requests_in_flight, metrics.overloaded),
                max_body_bytes=settings.max_body_bytes,
                body_timeout_s=settings.request_body_timeout_s,
            )
            log.info("gateway_ready", port=settings.gateway_port, sessions_url=settings.sessions_url)
            yield
        finally:
            await upstream.aclose()
            await db.close()
            await pipe.aclose()
            await client.aclose()

    app = FastAPI(
        telemetry=NO_FASTAPI_TELEMETRY,
        title="Axon",
        summary="OpenAI-compatible API for large language models.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(HotRoutes, routes=routes.HOT_ROUTES)  # inside the request context below
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics.http,
        quiet_paths=PROBE_PATHS,
    )
    app.include_router(routes.router)
    app.include_router(admin.router)
    app.include_router(playground.create_router())

    install_probes(
        app,
        registry=metrics.registry,
        not_ready_reason=_not_ready_reason,
        ready_doc="Readiness: Redis answers and the session manager is ready.",
    )
    return app


async def _not_ready_reason(app: FastAPI) -> str | None:
    try:
        await app.state.redis.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return f"Redis unreachable: {exc!r}"
    try:
        async with asyncio.timeout(_SESSIONS_READY_TIMEOUT_S):
            upstream = await app.state.upstream.request("GET", "/ready")
            body = await upstream.read()
    except (OSError, TimeoutError, RemoteProtocolError) as exc:
        return f"session manager unreachable: {exc!r}"
    if upstream.status != 200:
        try:
            return f"session manager not ready: {orjson.loads(body)['reason']}"
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return "session manager not ready"
    return None
