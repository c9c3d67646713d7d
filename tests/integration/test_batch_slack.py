"""A batch's owner releases a tenant's lines of a model while fewer than `ahead` wait in its batch
queue: the tenant's with the fair share on, the model's with it off (the real RabbitMQ and Redis)."""

import time
import uuid

import pytest

from services.sessions.batches import slack
from services.sessions.batches.slack import QueueSlack
from services.sessions.job_publishing import JobPublisher
from shared.clients import connect_amqp
from shared.fair import FairShare
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Job


@pytest.fixture
async def broker(namespace, service_urls):
    connection = await connect_amqp(service_urls.amqp, timeout_s=5)
    names = Names(f"{namespace}-slack-{uuid.uuid4().hex[:6]}")
    yield connection, names
    channel = await connection.channel()
    await channel.queue_delete(names.batch_queue("m"))
    await channel.queue_delete(names.tenant_queue("m", "anonymous", batch=True))
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


@pytest.mark.parametrize("fair", [True, False], ids=["tenant-queue", "model-queue"])
async def test_room_is_ahead_less_the_lines_waiting(
    broker, service_urls, monkeypatch: pytest.MonkeyPatch, fair: bool
) -> None:
    connection, names = broker
    monkeypatch.setattr(slack, "FRESH_S", 0.0)
    queue_slack = QueueSlack(connection, names, ahead=2, fair=fair)
    assert await queue_slack.take("m", "anonymous")  # no queue yet: nothing waits (a line wakes the pool)
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    fair_share = FairShare(pipe, names) if fair else None
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5, fair=fair_share)
    await publisher.start()
    await publish_line(publisher, names)
    assert await queue_slack.take("m", "anonymous")  # one waits, one more may
    await publish_line(publisher, names)
    assert not await queue_slack.take("m", "anonymous")  # two wait: none
    assert await queue_slack.take("m", "another") == fair  # another tenant's lines wait apart
    channel = await connection.channel()
    name = names.tenant_queue("m", "anonymous", batch=True) if fair else names.batch_queue("m")
    queue = await channel.get_queue(name)
    message = await queue.get(timeout=5)  # a worker took one into a free sequence
    await message.ack()
    assert await queue_slack.take("m", "anonymous")
    assert await queue_slack.take("never-declared", "anonymous")  # its channel was closed by the broker: a new one
    await pipe.aclose()


async def test_an_answer_is_reused_while_fresh_less_the_lines_taken(broker, monkeypatch: pytest.MonkeyPatch) -> None:
    connection, names = broker
    monkeypatch.setattr(slack, "FRESH_S", 3600.0)
    queue_slack = QueueSlack(connection, names, ahead=3, fair=False)
    publisher = JobPublisher(connection, names, max_queued_jobs=10, publish_timeout_s=5)
    await publisher.start()
    await publish_line(publisher, names)
    assert [await queue_slack.take("m", "t") for _ in range(3)] == [True, True, False]  # asked once: 3 - 1 waiting
    await (await (await connection.channel()).get_queue(names.batch_queue("m"))).purge()
    assert not await queue_slack.take("m", "t")  # within FRESH_S: not asked again
