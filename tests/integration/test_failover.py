"""Failover against the real Redis: progress recorded with each chunk, resumed after a crash,
a finished job recognised on redelivery, and a job given up past `max_deliveries`."""

import time
import uuid

import pytest

from services.worker.chunk_publisher import ChunkPublisher
from services.worker.engines import EngineOutput
from services.worker.failover import Failover, Progress
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Job


@pytest.fixture
async def pipe(service_urls):
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    yield pipe
    await pipe.aclose()


def _publisher(pipe: RedisPipe, names: Names, job_id: str, progress: Progress) -> ChunkPublisher:
    channel = names.tokens_channel(job_id)
    return ChunkPublisher(pipe, names, job_id=job_id, channel=channel, deadline=time.time() + 60, progress=progress)


async def test_a_crashed_attempt_is_resumed_and_a_finished_one_is_recognised(pipe, namespace) -> None:
    names, job_id = Names(f"{namespace}-progress"), str(uuid.uuid4())
    failover = Failover(pipe, names, max_deliveries=3)
    first = _publisher(pipe, names, job_id, Progress())
    await first.publish(EngineOutput("Hello", 1, 7, 1, token_ids=(11,)))
    await first.publish(EngineOutput(" world", 1, 7, 2, token_ids=(12,)))

    progress = await failover.load_progress(job_id)  # the worker died: another one takes the job over
    resume = progress.resume
    assert resume is not None and (resume.text, resume.token_ids, resume.completion_tokens) == (
        "Hello world",
        (11, 12),
        2,
    )
    assert (progress.seq, progress.done) == (2, False)
    again = _publisher(pipe, names, job_id, progress)
    await again.publish(EngineOutput("!", 1, 7, 3, finish_reason="stop", token_ids=(13,)))

    # Its ack was lost with the broker connection: the job comes once more, and is known done.
    third = await failover.load_progress(job_id)
    assert third.done and third.resume is None
    ttl = await pipe.execute("TTL", names.job_progress(job_id))
    assert 0 < ttl <= 60 + 60
    assert await pipe.execute("EXISTS", names.job_progress_text(job_id), names.job_progress_tokens(job_id)) == 0


async def test_a_job_is_given_up_once_delivered_more_than_max_deliveries(pipe, namespace) -> None:
    names = Names(f"{namespace}-deliveries")
    failover = Failover(pipe, names, max_deliveries=3)
    job = Job(job_id=str(uuid.uuid4()), model="m", channel="c", prompt="p", deadline=time.time() + 60)
    # The first delivery is not counted: the second and third go on, the fourth is given up.
    assert [await failover.count_redelivery(job) for _ in range(3)] == [
        None,
        None,
        "delivered 4 times without finishing (AXON_MAX_DELIVERIES=3)",
    ]
    assert 0 < await pipe.execute("TTL", names.job_deliveries(job.job_id)) <= 60 + 60
