"""What the gateway opens while it serves: its connections, closed together on the way out."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg
import redis.asyncio as redis

from services.gateway.settings import GatewaySettings
from shared.clients import create_redis
from shared.http1 import Http1Client
from shared.redis_pipe import RedisPipe

UPSTREAM_KEEPALIVE_S = 2.0


@dataclass(frozen=True)
class GatewayClients:
    """The gateway's connections: the session manager, Redis (plain and pipelined) and PostgreSQL."""

    upstream: Http1Client
    redis: redis.Redis
    pipe: RedisPipe
    db: asyncpg.Pool


@asynccontextmanager
async def open_clients(settings: GatewaySettings) -> AsyncIterator[GatewayClients]:
    """Open the gateway's connections, and close them all on the way out."""
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
    try:
        yield GatewayClients(upstream=upstream, redis=client, pipe=pipe, db=db)
    finally:
        await upstream.aclose()
        await db.close()
        await pipe.aclose()
        await client.aclose()
