"""The gateway's app factory: the public, OpenAI-compatible door."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI

from services.gateway import playground
from services.gateway.admission import Admitter, ModelAccess
from services.gateway.api import admin, docs, landing, message_batches, routes
from services.gateway.api.openapi import TAGS, install_request_schemas, install_tags
from services.gateway.auth import Authenticator
from services.gateway.metrics import GatewayMetrics
from services.gateway.proxy import Forwarder, GatewayService, InFlightLimit
from services.gateway.resources import GatewayClients, open_clients
from services.gateway.settings import GatewaySettings
from shared.hot_routes import HotRoutes
from shared.http1 import RemoteProtocolError
from shared.http_errors import install_error_handlers
from shared.internal_auth import internal_headers
from shared.keys import KeyRepository
from shared.logging import get_logger
from shared.middleware import NO_FASTAPI_TELEMETRY, RequestContextMiddleware
from shared.names import Names
from shared.probes import PROBE_PATHS, install_probes
from shared.ratelimit import RateLimiter
from shared.registry import WorkerRegistry
from shared.settings import InsecureConfiguration
from shared.tenants import keep_weights_synced
from shared.tracing import Tracing

log = get_logger(__name__)


_SESSIONS_READY_TIMEOUT_S = 3.0


def _attach_services(
    app: FastAPI,
    clients: GatewayClients,
    *,
    settings: GatewaySettings,
    metrics: GatewayMetrics,
    tracing: Tracing | None,
) -> None:
    """Build the gateway's services on its connections and put them on `app.state`, for the routes."""
    names = Names(settings.namespace)
    keys = KeyRepository(clients.db)
    app.state.upstream = clients.upstream
    app.state.internal_headers = internal_headers(settings.require_internal_token())
    app.state.redis = clients.redis
    app.state.db = clients.db
    app.state.keys = keys
    app.state.names = names
    app.state.authenticator = Authenticator(
        repository=keys,
        client=clients.redis,
        names=names,
        metrics=metrics,
        local_ttl_s=settings.key_cache_local_ttl_s,
        redis_ttl_s=settings.key_cache_ttl_s,
    )
    admitter = Admitter(
        limiter=RateLimiter(clients.pipe, names),
        metrics=metrics,
        fail_open=settings.rate_limit_fail_open,
        lease_s=settings.concurrency_lease_s,
    )
    app.state.gateway = GatewayService(
        forwarder=Forwarder(clients.upstream, internal_token=settings.require_internal_token()),
        authenticator=app.state.authenticator,
        admitter=admitter,
        model_access=ModelAccess(WorkerRegistry(clients.redis, names), cache_ttl_s=settings.models_cache_ttl_s),
        in_flight=InFlightLimit(settings.max_requests_in_flight, metrics.overloaded),
        max_body_bytes=settings.max_body_bytes,
        file_max_bytes=settings.file_max_bytes,
        body_timeout_s=settings.request_body_timeout_s,
        default_max_tokens=settings.default_max_tokens,
        max_tokens_limit=settings.max_tokens_limit,
        tracing=tracing,
    )


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """Build the gateway app.

    Raises:
        InsecureConfiguration: no admin token, or a short or well-known one; no internal token,
            or a short one; only one of the TLS files, or one that cannot be used.
    """
    settings = settings or GatewaySettings()
    settings.require_internal_token()
    problem = settings.admin_token_problem()
    if problem is not None:
        raise InsecureConfiguration(f"Refusing to start the admin API: {problem}.")
    problem = settings.tls_problem()
    if problem is not None:
        raise InsecureConfiguration(f"Refusing to start HTTPS: {problem}.")
    metrics = GatewayMetrics()
    tracing = Tracing.of(settings, service="axon-gateway", registry=metrics.registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with open_clients(settings) as clients:
                _attach_services(app, clients, settings=settings, metrics=metrics, tracing=tracing)
                syncing = asyncio.create_task(
                    keep_weights_synced(
                        clients.db, clients.redis, app.state.names, interval_s=settings.tenant_weights_sync_s
                    )
                )
                log.info("gateway_ready", port=settings.gateway_port, sessions_url=settings.sessions_url)
                try:
                    yield
                finally:
                    syncing.cancel()
                    await asyncio.gather(syncing, return_exceptions=True)
        finally:
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(
        telemetry=NO_FASTAPI_TELEMETRY,
        title="Axon",
        summary="OpenAI-compatible API for large language models.",
        version="0.1.0",
        openapi_tags=TAGS,
        lifespan=lifespan,
        # /docs is served by api/docs.py from the gateway's own copy of Swagger UI, not a CDN.
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(HotRoutes, routes=routes.HOT_ROUTES)  # inside the request context below
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics.http,
        quiet_paths=PROBE_PATHS,
        tracing=tracing,
    )
    app.include_router(routes.router)
    app.include_router(message_batches.router)
    app.include_router(admin.router)
    app.include_router(playground.create_router())
    app.include_router(docs.router)
    app.include_router(landing.router)
    install_request_schemas(app)

    install_probes(
        app,
        registry=metrics.registry,
        not_ready_reason=_not_ready_reason,
        ready_doc="Readiness: Redis answers and the session manager is ready.",
        # The public port: what the platform serves and how much is for its operators only.
        metrics_token=None if settings.metrics_public else settings.require_internal_token(),
    )
    install_tags(app)
    return app


async def _not_ready_reason(app: FastAPI) -> str | None:
    try:
        await app.state.redis.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return f"Redis unreachable: {exc!r}"
    try:
        async with asyncio.timeout(_SESSIONS_READY_TIMEOUT_S):
            upstream = await app.state.upstream.request("GET", "/ready", headers=app.state.internal_headers)
            body = await upstream.read()
    except (OSError, TimeoutError, RemoteProtocolError) as exc:
        return f"session manager unreachable: {exc!r}"
    if upstream.status != 200:
        try:
            return f"session manager not ready: {orjson.loads(body)['reason']}"
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return "session manager not ready"
    return None
