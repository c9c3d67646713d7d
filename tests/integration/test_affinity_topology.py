"""Session affinity on RabbitMQ's own primitives, against the real broker: a job sent to a worker's
own queue waits there at most its per-message TTL, then RabbitMQ dead-letters it to the model's
shared queue; a dead worker's jobs and jobs handed back after their TTL reach the shared queue;
a worker queue that is gone makes the broker return the job, which then goes to the shared queue."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection
from prometheus_client import CollectorRegistry, Counter

from services.sessions.job_publishing import JobPublisher
from shared.clients import connect_amqp
from shared.names import Names
from shared.schemas import Job
from shared.topology import declare_job_queue, declare_worker_queue, spilled_from_worker_queue

MODEL = "m"
WAIT_MS = 300


@pytest.fixture
async def broker(namespace, service_urls) -> AsyncIterator[tuple[AbstractRobustConnection, Names]]:
    connection = await connect_amqp(service_urls.amqp, timeout_s=5)
    names = Names(f"{namespace}-aff-{uuid.uuid4().hex[:6]}")
    yield connection, names
    channel = await connection.channel()
    for queue in (
        names.jobs_queue(MODEL),
        names.worker_queue(MODEL, "w1"),
        names.worker_queue(MODEL, "w2"),
        names.dead_letter_queue,
    ):
        await channel.queue_delete(queue)
    await channel.exchange_delete(names.jobs_exchange)
    await channel.exchange_delete(names.dead_letter_exchange)
    await connection.close()


def _job(names: Names, *, deadline_in_s: float = 60) -> Job:
    job_id = str(uuid.uuid4())
    return Job(
        job_id=job_id,
        model=MODEL,
        prompt="hi",
        channel=names.tokens_channel(job_id),
        deadline=time.time() + deadline_in_s,
        session_id=str(uuid.uuid4()),
    )


async def _publisher(connection: AbstractRobustConnection, names: Names, routed: Counter | None = None) -> JobPublisher:
    publisher = JobPublisher(
        connection, names, max_queued_jobs=10, publish_timeout_s=5, affinity_wait_ms=WAIT_MS, routed=routed
    )
    await publisher.start()
    return publisher


async def _queues(connection: AbstractRobustConnection, names: Names, worker_id: str) -> tuple[AbstractQueue, ...]:
    channel = await connection.channel()
    shared = await declare_job_queue(channel, names, MODEL, max_queued_jobs=10)
    own = await declare_worker_queue(channel, names, MODEL, worker_id)
    return shared, own


async def _arrival(queue: AbstractQueue, *, within_s: float) -> tuple[AbstractIncomingMessage, float]:
    """The next message of `queue` and when it was there (monotonic), polling every 20 ms."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        message = await queue.get(fail=False)
        if message is not None:
            return message, time.monotonic()
        await asyncio.sleep(0.02)
    raise AssertionError(f"nothing arrived in {queue.name} within {within_s} s")


async def test_a_job_for_a_consuming_home_worker_is_in_its_own_queue_at_once(broker) -> None:
    connection, names = broker
    shared, own = await _queues(connection, names, "w1")
    publisher = await _publisher(connection, names)
    job = _job(names)
    await publisher.publish(job, priority=4, request_id="r", home="w1")
    message, _ = await _arrival(own, within_s=0.2)
    assert Job.model_validate_json(message.body) == job
    assert message.priority == 4  # the worker's queue honours priorities like the shared one
    assert message.expiration is not None and float(message.expiration) <= WAIT_MS / 1000
    assert not spilled_from_worker_queue(message.headers or {})
    await message.ack()
    assert await shared.get(fail=False) is None


async def test_a_job_left_waiting_in_its_home_queue_spills_to_the_shared_queue_after_the_wait(broker) -> None:
    connection, names = broker
    shared, own = await _queues(connection, names, "w1")
    publisher = await _publisher(connection, names)
    job = _job(names)
    sent = time.monotonic()
    await publisher.publish(job, priority=6, request_id="r", home="w1")
    message, arrived = await _arrival(shared, within_s=3)
    assert WAIT_MS / 1000 * 0.9 <= arrived - sent < WAIT_MS / 1000 + 1.0
    assert Job.model_validate_json(message.body) == job
    assert message.priority == 6
    assert not message.redelivered
    death = message.headers["x-death"][0]
    assert (death["reason"], death["queue"]) == ("expired", names.worker_queue(MODEL, "w1"))
    assert spilled_from_worker_queue(message.headers)
    # RabbitMQ removes a dead-lettered message's expiration: the worker checks the job's deadline.
    assert message.expiration is None
    await message.ack()
    assert await own.get(fail=False) is None


async def test_a_dead_workers_unacked_job_reaches_the_shared_queue(broker, service_urls) -> None:
    connection, names = broker
    shared, _ = await _queues(connection, names, "w2")
    publisher = await _publisher(connection, names)
    job = _job(names)
    await publisher.publish(job, priority=0, request_id="r", home="w2")
    # The home worker takes the job on a connection of its own, then dies with it unacked.
    worker = await connect_amqp(service_urls.amqp, timeout_s=5)
    channel = await worker.channel()
    own = await channel.get_queue(names.worker_queue(MODEL, "w2"), ensure=False)
    taken, _ = await _arrival(own, within_s=0.2)
    assert taken.message_id == job.job_id
    await asyncio.sleep(WAIT_MS / 1000 + 0.1)
    died = time.monotonic()
    await worker.close()
    # Requeued into its own queue with its original (passed) expiry: dead-lettered at once.
    message, arrived = await _arrival(shared, within_s=3)
    assert arrived - died < 1.0
    assert message.message_id == job.job_id
    assert spilled_from_worker_queue(message.headers or {})
    await message.ack()


async def test_a_job_handed_back_after_its_wait_goes_straight_to_the_shared_queue(broker) -> None:
    connection, names = broker
    shared, own = await _queues(connection, names, "w1")
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5, affinity_wait_ms=1500)
    await publisher.start()
    job = _job(names)
    await publisher.publish(job, priority=0, request_id="r", home="w1")
    taken, taken_at = await _arrival(own, within_s=0.2)
    await asyncio.sleep(1.7 - (time.monotonic() - taken_at))
    handed_back = time.monotonic()
    await taken.nack(requeue=True)  # a drain's hand-back, past the 1.5 s wait
    message, arrived = await _arrival(shared, within_s=3)
    # The requeued message keeps its original expiry: it does not wait another 1.5 s.
    assert arrived - handed_back < 0.5
    assert message.message_id == job.job_id and spilled_from_worker_queue(message.headers or {})
    await message.ack()
    assert await own.get(fail=False) is None


async def test_a_job_whose_home_queue_is_gone_is_returned_and_goes_to_the_shared_queue(broker) -> None:
    connection, names = broker
    channel = await connection.channel()
    shared = await declare_job_queue(channel, names, MODEL, max_queued_jobs=10)
    routed = Counter("routed", "jobs by route", ["model", "route"], registry=CollectorRegistry())
    publisher = await _publisher(connection, names, routed)
    job = _job(names, deadline_in_s=60)
    await publisher.publish(job, priority=0, request_id="r", home="never-declared")  # mandatory: returned
    await publisher.publish(_job(names), priority=0, request_id="r")
    assert routed.labels(MODEL, "home_missing")._value.get() == 1
    assert routed.labels(MODEL, "shared")._value.get() == 1
    assert routed.labels(MODEL, "home")._value.get() == 0
    message, _ = await _arrival(shared, within_s=1)
    assert message.message_id == job.job_id
    await (await _arrival(shared, within_s=1))[0].ack()
    assert "x-death" not in (message.headers or {})
    # Published anew to the shared queue: it expires at the job's deadline, not after the wait.
    assert message.expiration is not None and float(message.expiration) > 50
    await message.ack()


async def test_affinity_off_sends_a_sessions_job_to_the_shared_queue(broker) -> None:
    connection, names = broker
    shared, own = await _queues(connection, names, "w1")
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5, affinity_wait_ms=0)
    await publisher.start()
    job = _job(names)
    await publisher.publish(job, priority=0, request_id="r", home="w1")
    message, _ = await _arrival(shared, within_s=0.5)
    assert message.message_id == job.job_id
    await message.ack()
    assert await own.get(fail=False) is None
