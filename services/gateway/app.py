"""The gateway's app factory: the public, OpenAI-compatible door."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response

from shared.clients import create_redis
from shared.keys import KeyRepository
from shared.logging import get_logger
from shared.names import Names
from shared.ratelimit import RateLimiter
from shared.web import ORJSONResponse, RequestContextMiddleware, install_error_handlers, metrics_response
from services.gateway import playground
from services.gateway.api import admin, routes
from services.gateway.auth import Admitter, Authenticator
from services.gateway.metrics import GatewayMetrics
from services.gateway.service import Forwarder, GatewayService
from services.gateway.settings import GatewaySettings

log = get_logger(__name__)


UPSTREAM_KEEPALIVE_S = 2.0


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
        timeout = aiohttp.ClientTimeout(
            total=None, connect=settings.upstream_connect_timeout_s, sock_read=settings.upstream_timeout_s
        )
        # Idle upstream connections are dropped before the session manager's keep-alive
        # timeout, so the gateway never reuses one the other side is closing.
        connector = aiohttp.TCPConnector(
            limit=settings.upstream_max_connections, keepalive_timeout=UPSTREAM_KEEPALIVE_S
        )
        client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
        # min_size=0: the gateway starts (and serves cached keys) even while PostgreSQL is down.
        db = await asyncpg.create_pool(
            settings.database_url, min_size=0, max_size=10, timeout=settings.connect_timeout_s,
            command_timeout=settings.connect_timeout_s,
        )
        keys = KeyRepository(db)
        try:
            # Bodies pass through unchanged: no decompression, no added headers.
            async with aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding")
            ) as upstream:
                app.state.upstream = upstream
                app.state.redis = client
                app.state.db = db
                app.state.keys = keys
                app.state.names = names
                app.state.authenticator = Authenticator(
                    repository=keys, client=client, names=names, metrics=metrics,
                    local_ttl_s=settings.key_cache_local_ttl_s, redis_ttl_s=settings.key_cache_ttl_s,
                )  # fmt: skip
                admitter = Admitter(
                    limiter=RateLimiter(client, names), metrics=metrics,
                    fail_open=settings.rate_limit_fail_open, lease_s=settings.concurrency_lease_s,
                )  # fmt: skip
                app.state.gateway = GatewayService(
                    forwarder=Forwarder(upstream, settings.sessions_url, timeout=timeout),
                    admitter=admitter, max_body_bytes=settings.max_body_bytes,
                )
                log.info("gateway_ready", port=settings.gateway_port, sessions_url=settings.sessions_url)
                yield
        finally:
            await db.close()
            await client.aclose()

    app = FastAPI(
        title="Axon",
        summary="OpenAI-compatible API for large language models.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics.http,
        quiet_paths=frozenset({"/health", "/ready", "/metrics"}),
    )
    app.include_router(routes.router)
    app.include_router(admin.router)
    app.include_router(playground.create_router())

    @app.get("/health")
    async def health() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Readiness: Redis answers and the session manager is ready."""
        reason = await _not_ready_reason(request.app)
        if reason is not None:
            return ORJSONResponse({"status": "not_ready", "reason": reason}, status_code=503)
        return ORJSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        """Prometheus metrics."""
        return metrics_response(metrics.registry)

    return app


async def _not_ready_reason(app: FastAPI) -> str | None:
    try:
        await app.state.redis.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return f"Redis unreachable: {exc!r}"
    url = f"{app.state.settings.sessions_url.rstrip('/')}/ready"
    try:
        async with app.state.upstream.get(url, timeout=aiohttp.ClientTimeout(total=3)) as upstream:
            status = upstream.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"session manager unreachable: {exc!r}"
    if status != 200:
        return "session manager not ready"
    return None
