"""Connections to Redis and RabbitMQ, with a timeout on every wait."""

import asyncio
import logging

import aio_pika
import redis.asyncio as redis
from aio_pika.abc import AbstractRobustConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.outages import Outage


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


# The libraries' loggers that write a line (or three) for each attempt while the broker is away.
_RECONNECT_LOGGERS = ("aiormq.connection", "aio_pika.robust_connection", "aio_pika.tools")


class _BrokerOutage(logging.Filter):
    """A broker outage logged once (`amqp_failed`, then `amqp_recovered` with its duration and
    the lines held back), instead of aio-pika's and aiormq's lines for every reconnect attempt,
    which it drops while the broker is away: a filter on their loggers, and callbacks on each
    robust connection. One per process, shared by its connections (to the same broker)."""

    def __init__(self) -> None:
        super().__init__()
        self._outage = Outage("amqp")
        self._held_back = 0

    def install(self, connection: AbstractRobustConnection) -> None:
        connection.close_callbacks.add(self._closed)
        connection.reconnect_callbacks.add(self._reconnected)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._outage.down:
            return True
        self._held_back += 1
        return False

    def _closed(self, _connection: object, exc: BaseException | None) -> None:
        if exc is not None and not isinstance(exc, asyncio.CancelledError):
            self._outage.failed(exc)

    def _reconnected(self, _connection: object) -> None:
        self._outage.recovered(lines_held_back=self._held_back)
        self._held_back = 0


_broker_outage = _BrokerOutage()
for _name in _RECONNECT_LOGGERS:
    logging.getLogger(_name).addFilter(_broker_outage)


async def connect_amqp(url: str, *, timeout_s: float) -> AbstractRobustConnection:
    """Open a robust (auto-reconnecting) AMQP connection, failing after `timeout_s`.

    The connection, its channels, the topology declared on them and its consumers are restored
    by aio-pika after the broker comes back, retried every `AMQP_RECONNECT_INTERVAL_S`; the
    outage is logged once, and its end (`_BrokerOutage`).
    """
    connection = await aio_pika.connect_robust(url, timeout=timeout_s, reconnect_interval=AMQP_RECONNECT_INTERVAL_S)
    _broker_outage.install(connection)
    return connection
