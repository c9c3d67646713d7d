"""The job queue topology on RabbitMQ: the jobs exchange, one durable queue per model, and the
dead-letter queue.

Every service declares the topology it touches with the same arguments, so any of them may come
up first.
"""

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractQueue

from shared.names import Names

# RabbitMQ priorities 0-9 (a key's tier); higher is served first.
MAX_JOB_PRIORITY = 9


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
