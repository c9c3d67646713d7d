"""Connections to Redis and RabbitMQ with timeouts, and the job queue topology.

Every service declares the topology it touches with the same arguments, so any of
them may come up first.
"""

import aio_pika
import redis.asyncio as redis
from aio_pika.abc import AbstractChannel, AbstractQueue, AbstractRobustConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.names import Names

# RabbitMQ priorities 0-9 (a key's tier); higher is served first.
MAX_JOB_PRIORITY = 9


def create_redis(url: str, *, timeout_s: float, for_pubsub: bool = False, max_connections: int = 256) -> redis.Redis:
    """Return a Redis client whose every command times out after `timeout_s`.

    Args:
        url: `redis://` URL.
        timeout_s: connect and per-command timeout; also how long a command waits for a
            free pooled connection under a burst (instead of failing at once).
        for_pubsub: a subscriber blocks on reads by design, so it gets no read timeout.
        max_connections: pool size.
    """
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3)
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        socket_timeout=None if for_pubsub else timeout_s,
        health_check_interval=0 if for_pubsub else 30,
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


async def declare_job_queue(
    channel: AbstractChannel,
    names: Names,
    model: str,
    *,
    max_queued_jobs: int,
) -> AbstractQueue:
    """Declare the jobs exchange, the model's durable queue and the dead-letter queue.

    The queue refuses publishes past `max_queued_jobs` (`reject-publish`), which turns
    into an early 503 for the caller instead of an ever-growing backlog.
    """
    dead_exchange = await channel.declare_exchange(
        names.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
    )
    dead_queue = await channel.declare_queue(names.dead_letter_queue, durable=True)
    await dead_queue.bind(dead_exchange)
    jobs_exchange = await channel.declare_exchange(names.jobs_exchange, aio_pika.ExchangeType.DIRECT, durable=True)
    queue = await channel.declare_queue(
        names.jobs_queue(model),
        durable=True,
        arguments={
            "x-max-priority": MAX_JOB_PRIORITY,
            "x-dead-letter-exchange": names.dead_letter_exchange,
            "x-max-length": max_queued_jobs,
            "x-overflow": "reject-publish",
        },
    )
    await queue.bind(jobs_exchange, routing_key=model)
    return queue
