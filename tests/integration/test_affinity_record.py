"""The affinity record a session job's answer writes, in the same publish script as its final chunk,
against the real Redis: the worker's id for an hour; nothing for a sessionless job or an error."""

import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis

from services.worker.chunk_publisher import ChunkPublisher, Home
from services.worker.engines import EngineOutput
from services.worker.failover import Progress
from shared.affinity import AFFINITY_TTL_S
from shared.names import Names
from shared.redis_pipe import RedisPipe


@pytest.fixture
async def pipe(service_urls) -> AsyncIterator[RedisPipe]:
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    yield pipe
    await pipe.aclose()


def publisher(pipe: RedisPipe, names: Names, home: Home | None) -> ChunkPublisher:
    job_id = str(uuid.uuid4())
    return ChunkPublisher(
        pipe,
        names,
        job_id=job_id,
        channel=names.tokens_channel(job_id),
        deadline=time.time() + 60,
        progress=Progress(),
        home=home,
    )


async def test_a_session_answers_final_chunk_names_its_worker_as_home(
    pipe: RedisPipe, redis_client: redis.Redis, namespace: str
) -> None:
    names = Names(f"{namespace}-home-{uuid.uuid4().hex[:6]}")
    key = names.affinity(str(uuid.uuid4()))
    chunks = publisher(pipe, names, Home(key, "worker-7"))
    await chunks.publish(EngineOutput("Hello", 1, 5, 1))
    assert await redis_client.get(key) is None  # only the final chunk records it
    await chunks.publish(EngineOutput(" there", 1, 5, 2, finish_reason="length"))
    assert await redis_client.get(key) == b"worker-7"
    assert AFFINITY_TTL_S - 5 <= await redis_client.ttl(key) <= AFFINITY_TTL_S
    await redis_client.delete(key)


async def test_an_error_or_a_sessionless_answer_records_no_home(
    pipe: RedisPipe, redis_client: redis.Redis, namespace: str
) -> None:
    names = Names(f"{namespace}-home-{uuid.uuid4().hex[:6]}")
    key = names.affinity(str(uuid.uuid4()))
    await publisher(pipe, names, Home(key, "worker-7")).finish_with_error("deadline passed", "timeout_error")
    await publisher(pipe, names, None).publish(EngineOutput("Hi", 1, 5, 1, finish_reason="stop"))
    assert await redis_client.get(key) is None
    assert await redis_client.keys(names.affinity("*")) == []
