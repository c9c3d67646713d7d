"""The job queue topology on RabbitMQ: the jobs exchange, one durable queue per model, one queue
per worker (session affinity), one queue of batch lines per model, and the dead-letter queue.

Every service declares the topology it touches with the same arguments, so any of them may come
up first.
"""

from collections.abc import Mapping

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractQueue

from shared.names import Names

# RabbitMQ priorities 0-9 (a key's tier); higher is served first.
MAX_JOB_PRIORITY = 9
# Batch lines' jobs go at the lowest priority, alone: interactive jobs go at 1 or more (a key of
# priority 0 shares 1 with the keys of priority 1). They wait in a queue of their own
# (`declare_batch_queue`), which workers read only into free sequences.
BATCH_JOB_PRIORITY = 0


def job_priority(key_priority: int, *, batch: bool) -> int:
    """The broker priority of a job of a key of priority `key_priority` (`batch`: a batch line's)."""
    return BATCH_JOB_PRIORITY if batch else max(BATCH_JOB_PRIORITY + 1, min(key_priority, MAX_JOB_PRIORITY))


# The longest a session's job may wait in its home worker's queue (AXON_AFFINITY_WAIT_MS's bound).
MAX_AFFINITY_WAIT_MS = 60_000
# A worker's own queue is deleted this long after its last consumer left (the worker died).
# RabbitMQ drops, never dead-letters, the messages of a deleted queue, so this must outlast the
# longest per-message TTL in it by far; a job requeued there keeps its original expiry, which has
# usually passed, and leaves for the model's queue at once.
WORKER_QUEUE_EXPIRES_MS = 10 * MAX_AFFINITY_WAIT_MS


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
    arguments = {"x-max-priority": MAX_JOB_PRIORITY}
    return await _declare_bounded_queue(channel, names, names.jobs_queue(model), model, arguments, max_queued_jobs)


async def _declare_bounded_queue(
    channel: AbstractChannel,
    names: Names,
    name: str,
    routing_key: str,
    arguments: dict[str, int],
    max_queued_jobs: int,
) -> AbstractQueue:
    """Declare the dead-letter exchange and queue, the jobs exchange, and the durable queue `name`
    bound to it under `routing_key`: it refuses publishes past `max_queued_jobs` and dead-letters
    what expires."""
    dead_exchange = await channel.declare_exchange(
        names.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
    )
    dead_queue = await channel.declare_queue(names.dead_letter_queue, durable=True)
    await dead_queue.bind(dead_exchange)
    jobs_exchange = await channel.declare_exchange(names.jobs_exchange, aio_pika.ExchangeType.DIRECT, durable=True)
    queue = await channel.declare_queue(
        name,
        durable=True,
        arguments={
            **arguments,
            "x-dead-letter-exchange": names.dead_letter_exchange,
            "x-max-length": max_queued_jobs,
            "x-overflow": "reject-publish",
        },
    )
    await queue.bind(jobs_exchange, routing_key=routing_key)
    return queue


async def declare_batch_queue(
    channel: AbstractChannel,
    names: Names,
    model: str,
    *,
    max_queued_jobs: int,
) -> AbstractQueue:
    """Declare the jobs exchange and the model's durable queue of batch lines' jobs, bound under its
    own name. No worker consumes it: a worker takes one job at a time from it (`basic.get`) while
    it has a free sequence, and gives a line back to it when an interactive job needs the line's
    sequence (`services/worker/pulling.py`). Like the model's queue, it refuses publishes past
    `max_queued_jobs` and dead-letters to the dead-letter queue (declared too)."""
    name = names.batch_queue(model)
    return await _declare_bounded_queue(channel, names, name, name, {}, max_queued_jobs)


# A tenant's queue that no worker read for this long is deleted by the broker (its jobs' deadlines
# passed long before; a batch line's window is at most a day).
TENANT_QUEUE_EXPIRES_MS = 7 * 24 * 3600 * 1000


async def declare_tenant_queue(
    channel: AbstractChannel,
    names: Names,
    model: str,
    tenant: str,
    *,
    batch: bool,
    max_queued_jobs: int,
) -> AbstractQueue:
    """Declare the durable queue of one tenant's waiting jobs of `model` (`batch`: its batch
    lines'), bound to the jobs exchange under its own name. No worker consumes it: a worker takes
    one job at a time from it (`basic.get`) when the fair share picks the tenant for a free
    sequence (`shared/fair.py`, `services/worker/pulling.py`). Priorities order a tenant's own
    jobs; like the model's queue it refuses publishes past `max_queued_jobs` and dead-letters."""
    name = names.tenant_queue(model, tenant, batch=batch)
    arguments = {"x-expires": TENANT_QUEUE_EXPIRES_MS}
    if not batch:
        arguments["x-max-priority"] = MAX_JOB_PRIORITY
    return await _declare_bounded_queue(channel, names, name, name, arguments, max_queued_jobs)


async def declare_worker_queue(channel: AbstractChannel, names: Names, model: str, worker_id: str) -> AbstractQueue:
    """Declare one worker's own queue of `model` jobs, bound to the jobs exchange under its name.

    A job expired there (its per-message TTL, the affinity wait) is dead-lettered to the jobs
    exchange with the model's routing key, so it lands in the model's shared queue, where any
    worker takes it. Durable, not transient, so a broker restart keeps what waits in it (and
    RabbitMQ deprecates transient non-exclusive queues); not exclusive, since an exclusive queue
    is deleted with its connection and its messages with it, whereas a killed worker's jobs must
    reach the shared queue. `x-expires` removes it once its worker is gone for good.
    """
    jobs_exchange = await channel.declare_exchange(names.jobs_exchange, aio_pika.ExchangeType.DIRECT, durable=True)
    name = names.worker_queue(model, worker_id)
    queue = await channel.declare_queue(
        name,
        durable=True,
        arguments={
            "x-max-priority": MAX_JOB_PRIORITY,
            "x-dead-letter-exchange": names.jobs_exchange,
            "x-dead-letter-routing-key": model,
            "x-expires": WORKER_QUEUE_EXPIRES_MS,
        },
    )
    await queue.bind(jobs_exchange, routing_key=name)
    return queue


def spilled_from_worker_queue(headers: Mapping[str, object]) -> bool:
    """Whether a job reached the model's queue by expiring in a worker's own queue: RabbitMQ's
    `x-death` records an `expired` death (the model's queue dead-letters only to the dead-letter
    queue, which no worker reads, so that death was in a worker's queue). Such a job may have been
    delivered there before (its worker died or handed it back), so its progress must be read as
    for a redelivery."""
    deaths = headers.get("x-death")
    if not isinstance(deaths, list):
        return False
    return any(isinstance(death, dict) and death.get("reason") == "expired" for death in deaths)
