"""Who records a job's usage row, on the real Redis: its session manager when it receives the final
chunk; the worker itself when nobody does (the session manager is gone), unless a session manager
already charged the job from its progress (`billed`)."""

import time
import uuid
from collections.abc import AsyncIterator

import orjson
import pytest

from services.sessions.service import _MARK_BILLED
from services.worker.engines import EngineOutput
from services.worker.failover import Failover, Progress
from services.worker.publisher import ChunkPublisher, UsageOwner
from shared.names import Names
from shared.redis_pipe import RedisPipe
from tests.integration.test_chunks import Channel

OWNER = UsageOwner(tenant="acme", key_id="key_usage", model="sim-model")


@pytest.fixture
async def pipe(service_urls) -> AsyncIterator[RedisPipe]:
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    yield pipe
    await pipe.aclose()


@pytest.fixture
def names(namespace: str) -> Names:
    return Names(f"{namespace}-usage-{uuid.uuid4().hex[:8]}")  # an outbox no persister reads


def publisher_for(pipe: RedisPipe, names: Names, job_id: str, progress: Progress | None = None) -> ChunkPublisher:
    return ChunkPublisher(
        pipe,
        names,
        job_id=job_id,
        channel=names.tokens_channel(job_id),
        deadline=time.time() + 60,
        progress=progress or Progress(),
        owner=OWNER,
    )


async def usage_entries(pipe: RedisPipe, names: Names) -> list[dict]:
    entries = await pipe.execute("XRANGE", names.outbox, "-", "+")
    rows = []
    for _id, fields in entries:
        entry = dict(zip(fields[::2], fields[1::2], strict=True))
        assert entry[b"kind"] == b"usage"
        rows.append(orjson.loads(entry[b"row"]))
    return rows


async def test_final_chunk_nobody_receives_records_the_jobs_usage_row(pipe, names) -> None:
    job_id = str(uuid.uuid4())
    publisher = publisher_for(pipe, names, job_id)
    await publisher.publish(EngineOutput("one two", 2, 5, 2))
    assert await usage_entries(pipe, names) == []  # only a final chunk records
    await publisher.publish(EngineOutput(" three", 1, 5, 3, finish_reason="length"))
    [row] = await usage_entries(pipe, names)
    assert {k: v for k, v in row.items() if k != "created_at"} == {
        "job_id": job_id,
        "tenant": "acme",
        "key_id": "key_usage",
        "model": "sim-model",
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "latency_ms": None,
    }


async def test_final_chunk_received_by_a_session_manager_records_no_row(pipe, names, service_urls) -> None:
    job_id = str(uuid.uuid4())
    publisher = publisher_for(pipe, names, job_id)
    async with Channel(service_urls.redis, names.tokens_channel(job_id)) as channel:
        await publisher.publish(EngineOutput("one", 1, 5, 1))
        await publisher.finish_cancelled()
        await channel.chunks(2)
    assert await usage_entries(pipe, names) == []


async def test_job_its_session_manager_charged_from_progress_is_not_recorded_again(pipe, names) -> None:
    job_id = str(uuid.uuid4())
    first = publisher_for(pipe, names, job_id)
    await first.publish(EngineOutput("one two", 2, 5, 2))  # then its worker dies
    # The session manager gave up waiting for the final chunk: it charges the progress, marking it.
    published = await pipe.evalsha(_MARK_BILLED, [names.job_progress(job_id)], [60])
    assert published == [b"2", b"5"]
    progress = await Failover(pipe, names, max_deliveries=3).load_progress(job_id)
    resumed = publisher_for(pipe, names, job_id, progress)
    await resumed.publish(EngineOutput(" three", 1, 5, 1, finish_reason="length"))
    assert await usage_entries(pipe, names) == []


async def test_a_queued_job_marked_billed_starts_from_the_beginning(pipe, names) -> None:
    job_id = str(uuid.uuid4())
    assert await pipe.evalsha(_MARK_BILLED, [names.job_progress(job_id)], [60]) == [None, None]
    assert 0 < await pipe.execute("TTL", names.job_progress(job_id)) <= 60
    assert await Failover(pipe, names, max_deliveries=3).load_progress(job_id) == Progress()
