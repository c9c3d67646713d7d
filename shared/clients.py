"""Connections to Redis and RabbitMQ, with a timeout on every wait."""

import aio_pika
import redis.asyncio as redis
from aio_pika.abc import AbstractRobustConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def create_redis(url: str, *, timeout_s: float, max_connections: int = 256) -> redis.Redis:
    """Return a Redis client whose every command times out after `timeout_s`.

    Args:
        url: `redis://` URL.
        timeout_s: connect and per-command timeout; also how long a command waits for a
            free pooled connection under a burst (instead of failing at once).
        max_connections: pool size.
    """
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3)
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        health_check_interval=30,
        retry=retry,
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    return redis.Redis(connection_pool=pool)


# A robust connection retries this often while the broker is away (aio-pika's default is 5 s,
# half the time a restarted broker may take to be serving again).
AMQP_RECONNECT_INTERVAL_S = 1.0


async def connect_amqp(url: str, *, timeout_s: float) -> AbstractRobustConnection:
    """Open a robust (auto-reconnecting) AMQP connection, failing after `timeout_s`.

    The connection, its channels, the topology declared on them and its consumers are restored
    by aio-pika after the broker comes back, retried every `AMQP_RECONNECT_INTERVAL_S`.
    """
    return await aio_pika.connect_robust(url, timeout=timeout_s, reconnect_interval=AMQP_RECONNECT_INTERVAL_S)
