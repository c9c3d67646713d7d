"""JobPublisher and the queue topology against the real RabbitMQ."""

import time
import uuid

import aio_pika
import pytest

from services.sessions.job_publishing import JobPublisher
from shared.clients import connect_amqp
from shared.errors import Unavailable
from shared.names import Names
from shared.schemas import Job
from shared.topology import declare_job_queue


@pytest.fixture
async def broker(namespace, service_urls):
    connection = await connect_amqp(service_urls.amqp, timeout_s=5)
    names = Names(f"{namespace}-jobs-{uuid.uuid4().hex[:6]}")
    yield connection, names
    channel = await connection.channel()
    for queue in (names.jobs_queue("m"), names.dead_letter_queue):
        await channel.queue_delete(queue)
    await channel.exchange_delete(names.jobs_exchange)
    await channel.exchange_delete(names.dead_letter_exchange)
    await connection.close()


def _job(names: Names, *, model: str = "m", deadline_in_s: float = 60) -> Job:
    job_id = str(uuid.uuid4())
    return Job(
        job_id=job_id,
        model=model,
        prompt="hi",
        channel=names.tokens_channel(job_id),
        deadline=time.time() + deadline_in_s,
    )


async def test_published_job_is_persistent_with_id_priority_and_request_id(broker) -> None:
    connection, names = broker
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5)
    await publisher.start()
    job = _job(names)
    await publisher.publish(job, priority=7, request_id="req-1")
    channel = await connection.channel()
    queue = await declare_job_queue(channel, names, "m", max_queued_jobs=10)
    message = await queue.get(timeout=5)
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.message_id == job.job_id
    assert message.priority == 7
    assert message.headers["x-request-id"] == "req-1"
    assert Job.model_validate_json(message.body) == job
    await message.ack()


async def test_full_queue_refuses_at_once_with_unavailable(broker) -> None:
    connection, names = broker
    publisher = JobPublisher(connection, names, max_queued_jobs=2, publish_timeout_s=5)
    await publisher.start()
    await publisher.publish(_job(names), priority=0, request_id="a")
    await publisher.publish(_job(names), priority=0, request_id="b")
    started = time.monotonic()
    with pytest.raises(Unavailable) as caught:
        await publisher.publish(_job(names), priority=0, request_id="c")
    assert caught.value.code == "queue_full"
    assert caught.value.headers["Retry-After"]
    assert time.monotonic() - started < 2


async def test_expired_job_is_dead_lettered_by_the_broker(broker) -> None:
    connection, names = broker
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5)
    await publisher.start()
    job = _job(names, deadline_in_s=0.2)
    await publisher.publish(job, priority=0, request_id="x")
    channel = await connection.channel()
    dead = await channel.declare_queue(names.dead_letter_queue, durable=True)
    deadline = time.monotonic() + 5
    message = None
    while message is None and time.monotonic() < deadline:
        message = await dead.get(fail=False)
        if message is None:
            await __import__("asyncio").sleep(0.1)
    assert message is not None and message.message_id == job.job_id
    assert message.headers["x-death"][0]["reason"] == "expired"
    await message.ack()


async def test_a_job_whose_queue_vanished_is_refused_and_the_queue_comes_back(broker) -> None:
    connection, names = broker
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5)
    await publisher.start()
    await publisher.publish(_job(names), priority=0, request_id="declares the queue")
    channel = await connection.channel()
    await channel.queue_delete(names.jobs_queue("m"))  # an operator's mistake
    with pytest.raises(Unavailable, match="was missing"):
        await publisher.publish(_job(names), priority=0, request_id="returned unrouted")
    job = _job(names)
    await publisher.publish(job, priority=0, request_id="declared again")
    queue = await declare_job_queue(channel, names, "m", max_queued_jobs=10)
    message = await queue.get(timeout=5)
    assert message.message_id == job.job_id
    await message.ack()
