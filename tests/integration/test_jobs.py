"""JobPublisher and the queue topology against the real RabbitMQ."""

import time
import uuid

import aio_pika
import pytest
import structlog

from services.sessions.job_publishing import JobPublisher
from shared.clients import connect_amqp
from shared.errors import RateLimited, Unavailable
from shared.fair import INTERACTIVE, FairShare
from shared.internal_headers import ENQUEUED_AT_HEADER
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Job
from shared.topology import declare_job_queue, declare_tenant_queue


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


@pytest.fixture
async def fair_publisher(broker, service_urls):
    """A publisher with the fair share on (the real Redis); the tenant queue deleted after."""
    connection, names = broker
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    publisher = JobPublisher(connection, names, max_queued_jobs=4, publish_timeout_s=5, fair=FairShare(pipe, names))
    await publisher.start()
    yield publisher, pipe
    channel = await connection.channel()
    await channel.queue_delete(names.tenant_queue("m", "t1"))
    keys = await pipe.execute("KEYS", f"{names.namespace}:*")
    if keys:
        await pipe.execute("DEL", *keys)
    await pipe.aclose()


async def test_with_the_fair_share_a_job_waits_in_its_tenants_queue_counted_once(broker, fair_publisher) -> None:
    connection, names = broker
    publisher, pipe = fair_publisher
    job = _job(names).model_copy(update={"tenant": "t1"})
    await publisher.publish(job, priority=3, request_id="req-1")
    channel = await connection.channel()
    queue = await declare_tenant_queue(channel, names, "m", "t1", batch=False, max_queued_jobs=4)
    message = await queue.get(timeout=5)
    assert Job.model_validate_json(message.body) == job
    assert isinstance(message.headers[ENQUEUED_AT_HEADER], int)
    await message.ack()
    state = await FairShare(pipe, names).state("m", band=INTERACTIVE)
    assert state.waiting == {"t1": 1}


async def test_a_tenant_past_its_share_of_the_queue_is_refused_with_429(broker, fair_publisher) -> None:
    _connection, names = broker
    publisher, _pipe = fair_publisher
    for _ in range(4):  # alone, the tenant may fill the queue's length
        await publisher.publish(_job(names).model_copy(update={"tenant": "t1"}), priority=1, request_id="r")
    with pytest.raises(RateLimited) as refused:
        await publisher.publish(_job(names).model_copy(update={"tenant": "t1"}), priority=1, request_id="r")
    assert refused.value.code == "tenant_queue_full"
    assert refused.value.headers["Retry-After"] == "1"


async def test_redis_away_the_job_goes_first_in_first_out_said_once(broker) -> None:
    connection, names = broker
    # Nothing listens on that port: every fair-share call fails at once.
    pipe = RedisPipe("redis://127.0.0.1:1/0", timeout_s=1)
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5, fair=FairShare(pipe, names))
    await publisher.start()
    jobs = [_job(names) for _ in range(3)]
    # The log lines themselves, whatever an earlier test configured logging to write (not stdout).
    with structlog.testing.capture_logs() as logs:
        for job in jobs:
            await publisher.publish(job, priority=1, request_id="r")
    channel = await connection.channel()
    queue = await declare_job_queue(channel, names, "m", max_queued_jobs=10)
    got = []
    while (message := await queue.get(timeout=5, fail=False)) is not None:
        got.append(Job.model_validate_json(message.body).job_id)
        await message.ack()
    assert got == [job.job_id for job in jobs]  # each once, in order
    assert [entry["event"] for entry in logs].count("fair_share_failed") == 1
    await pipe.aclose()


async def test_a_broker_that_confirms_too_late_while_up_is_named_overload(broker) -> None:
    connection, names = broker
    # No broker confirms within a microsecond: the publish times out with the connection up.
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=1e-6)
    await publisher.start()
    with pytest.raises(Unavailable) as refused:
        await publisher.publish(_job(names), priority=1, request_id="r")
    assert refused.value.code == "overloaded"
    assert "overloaded" in refused.value.message and "unavailable" not in refused.value.message
    assert refused.value.headers["Retry-After"] == "2"
