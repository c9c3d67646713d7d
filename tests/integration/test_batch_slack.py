"""A batch's owner releases a model's lines while fewer than `ahead` wait in the model's batch queue
(the real RabbitMQ)."""

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
    await channel.queue_delete(names.batch_queue("m"))
    await channel.exchange_delete(names.jobs_exchange)
    await channel.exchange_delete(names.dead_letter_exchange)
    await channel.queue_delete(names.dead_letter_queue)
    await connection.close()


async def publish_line(publisher: JobPublisher, names: Names) -> None:
    job_id = str(uuid.uuid4())
    job = Job(
        job_id=job_id,
        model="m",
        prompt="hi",
        channel=names.tokens_channel(job_id),
        deadline=time.time() + 60,
        batch=True,
    )
    await publisher.publish(job, priority=0, request_id="line")


async def test_room_is_ahead_less_the_lines_waiting(broker, monkeypatch: pytest.MonkeyPatch) -> None:
    connection, names = broker
    monkeypatch.setattr(slack, "FRESH_S", 0.0)
    queue_slack = QueueSlack(connection, names, ahead=2)
    assert await queue_slack.take("m")  # no queue yet: nothing waits (a line wakes the pool)
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5)
    await publisher.start()
    await publish_line(publisher, names)
    assert await queue_slack.take("m")  # one waits, one more may
    await publish_line(publisher, names)
    assert not await queue_slack.take("m")  # two wait: none
    channel = await connection.channel()
    queue = await channel.get_queue(names.batch_queue("m"))
    message = await queue.get(timeout=5)  # a worker took one into a free sequence
    await message.ack()
    assert await queue_slack.take("m")
    assert await queue_slack.take("never-declared")  # its channel was closed by the broker: a new one


async def test_an_answer_is_reused_while_fresh_less_the_lines_taken(broker, monkeypatch: pytest.MonkeyPatch) -> None:
    connection, names = broker
    monkeypatch.setattr(slack, "FRESH_S", 3600.0)
    queue_slack = QueueSlack(connection, names, ahead=3)
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5)
    await publisher.start()
    await publish_line(publisher, names)
    assert [await queue_slack.take("m") for _ in range(3)] == [True, True, False]  # asked once: 3 - 1 waiting
    await (await (await connection.channel()).get_queue(names.batch_queue("m"))).purge()
    assert not await queue_slack.take("m")  # within FRESH_S: not asked again
