"""A model has slack for batch lines only while no job waits in its queue (the real RabbitMQ)."""

import asyncio
import time
import uuid

import pytest

from services.sessions.batches import slack
from services.sessions.batches.slack import QueueSlack
from services.sessions.job_publishing import JobPublisher
from shared.clients import connect_amqp
from shared.names import Names
from shared.schemas import Job


@pytest.fixture
async def broker(namespace, service_urls):
    connection = await connect_amqp(service_urls.amqp, timeout_s=5)
    names = Names(f"{namespace}-slack-{uuid.uuid4().hex[:6]}")
    yield connection, names
    channel = await connection.channel()
    await channel.queue_delete(names.jobs_queue("m"))
    await channel.exchange_delete(names.jobs_exchange)
    await channel.exchange_delete(names.dead_letter_exchange)
    await channel.queue_delete(names.dead_letter_queue)
    await connection.close()


async def test_slack_while_the_queue_is_empty_or_missing(broker, monkeypatch: pytest.MonkeyPatch) -> None:
    connection, names = broker
    monkeypatch.setattr(slack, "FRESH_S", 0.0)
    queue_slack = QueueSlack(connection, names)
    assert await queue_slack.has_slack("m")  # no queue yet: nothing waits (a line wakes the pool)
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5)
    await publisher.start()
    job_id = str(uuid.uuid4())
    job = Job(job_id=job_id, model="m", prompt="hi", channel=names.tokens_channel(job_id), deadline=time.time() + 60)
    await publisher.publish(job, priority=1, request_id="waiting")
    assert not await queue_slack.has_slack("m")  # a job waits: no worker has a free sequence
    channel = await connection.channel()
    queue = await channel.get_queue(names.jobs_queue("m"))
    message = await queue.get(timeout=5)
    await message.ack()
    await asyncio.sleep(0.1)
    assert await queue_slack.has_slack("m")
    assert await queue_slack.has_slack("never-declared")  # its channel was closed by the broker: a new one


async def test_an_answer_is_reused_while_fresh(broker, monkeypatch: pytest.MonkeyPatch) -> None:
    connection, names = broker
    monkeypatch.setattr(slack, "FRESH_S", 3600.0)
    queue_slack = QueueSlack(connection, names)
    assert await queue_slack.has_slack("m")
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5)
    await publisher.start()
    job_id = str(uuid.uuid4())
    job = Job(job_id=job_id, model="m", prompt="hi", channel=names.tokens_channel(job_id), deadline=time.time() + 60)
    await publisher.publish(job, priority=1, request_id="waiting")
    assert await queue_slack.has_slack("m")  # within FRESH_S: the answer before the job
