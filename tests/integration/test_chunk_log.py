"""Chunk logs against the real Redis: the worker's publish script logs each chunk once (a failover's
republished seq neither duplicates nor fails it), keeps the log for its lifetime and under its cap,
and the session manager's `ChunkLog` replays it and follows it to its final chunk."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from services.sessions.chunk_log import ChunkLog
from services.worker.chunk_publisher import CHUNK_LOG_MARGIN, ChunkLogTarget, ChunkPublisher, Home
from services.worker.engines import EngineOutput
from services.worker.failover import Failover, Progress
from shared.clients import create_redis
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Job, Sampling, TokenChunk
from tests.integration.test_chunks import Channel

TTL_S = 600


@pytest.fixture
async def pipe(service_urls) -> AsyncIterator[RedisPipe]:
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    yield pipe
    await pipe.aclose()


@pytest.fixture
async def chunk_log(service_urls, names) -> AsyncIterator[ChunkLog]:
    client = create_redis(service_urls.redis, timeout_s=5)
    yield ChunkLog(client, names, block_s=0.2)
    await client.aclose()


@pytest.fixture
def names(namespace) -> Names:
    return Names(f"{namespace}-chunk-log")


def job_of(max_tokens: int = 256, ttl_s: int | None = TTL_S, session_id: str | None = None) -> Job:
    return Job(
        job_id=str(uuid.uuid4()),
        model="m",
        channel="c",
        prompt="p",
        deadline=time.time() + 60,
        sampling=Sampling(max_tokens=max_tokens),
        chunk_log_ttl_s=ttl_s,
        session_id=session_id,
    )


def publisher_for(pipe: RedisPipe, names: Names, job: Job, progress: Progress, home: Home | None = None):
    return ChunkPublisher(
        pipe,
        names,
        job_id=job.job_id,
        channel=names.tokens_channel(job.job_id),
        deadline=job.deadline,
        progress=progress,
        home=home,
        chunk_log=ChunkLogTarget.of(job, names),
    )


async def logged(pipe: RedisPipe, names: Names, job_id: str) -> list[tuple[bytes, bytes]]:
    """The log's entries: (id, chunk JSON)."""
    entries = await pipe.execute("XRANGE", names.chunk_log(job_id), "-", "+")
    return [(entry_id, fields[1]) for entry_id, fields in entries]


async def test_each_chunk_is_logged_as_published_with_its_lifetime(pipe, names, service_urls) -> None:
    job = job_of()
    publisher = publisher_for(pipe, names, job, Progress())
    async with Channel(service_urls.redis, names.tokens_channel(job.job_id)) as channel:
        await publisher.publish(EngineOutput("Hello", 1, 4, 1))
        await publisher.publish(EngineOutput(" world", 1, 4, 2, finish_reason="stop"))
        await channel.chunks(2)
    assert await logged(pipe, names, job.job_id) == [(b"0-1", channel.raw[0]), (b"0-2", channel.raw[1])]
    assert TTL_S - 5 <= await pipe.execute("TTL", names.chunk_log(job.job_id)) <= TTL_S


async def test_a_running_jobs_log_outlives_its_deadline_and_only_the_ends_of_an_attempt_set_it(pipe, names) -> None:
    job = job_of()
    publisher = publisher_for(pipe, names, job, Progress())
    await publisher.publish(EngineOutput("a", 1, 4, 1))
    running_ttl = await pipe.execute("TTL", names.chunk_log(job.job_id))
    assert TTL_S + 60 + 55 <= running_ttl <= TTL_S + 60 + 60  # the deadline is 60 s ahead
    await pipe.execute("EXPIRE", names.chunk_log(job.job_id), 5000)
    await publisher.publish(EngineOutput("b", 1, 4, 2))  # not an end: its expiry stays
    assert await pipe.execute("TTL", names.chunk_log(job.job_id)) > running_ttl
    await publisher.publish(EngineOutput("c", 1, 4, 3, finish_reason="stop"))
    assert TTL_S - 5 <= await pipe.execute("TTL", names.chunk_log(job.job_id)) <= TTL_S


async def test_a_job_without_a_log_writes_none(pipe, names) -> None:
    job = job_of(ttl_s=None)
    assert ChunkLogTarget.of(job, names) is None
    await publisher_for(pipe, names, job, Progress()).publish(EngineOutput("Hi", 1, 4, 1, finish_reason="stop"))
    assert await pipe.execute("EXISTS", names.chunk_log(job.job_id)) == 0
    assert await pipe.execute("HGET", names.job_progress(job.job_id), "done") == b"1"


async def test_a_failover_republishing_a_logged_seq_neither_duplicates_nor_fails(pipe, names, service_urls) -> None:
    job = job_of(session_id="s1")
    first = publisher_for(pipe, names, job, Progress())
    await first.publish(EngineOutput("one", 1, 4, 1))
    await first.publish(EngineOutput(" two", 1, 4, 2))
    before = await logged(pipe, names, job.job_id)
    # The next worker starts from an older seq (say its progress read raced the last publish): seq 1
    # is republished with other text, then the answer goes on.
    progress = await Failover(pipe, names, max_deliveries=3).load_progress(job.job_id)
    stale = Progress(seq=1, prompt_tokens=progress.prompt_tokens, resume=progress.resume)
    home = Home(names.affinity("s1"), "worker-2")
    second = publisher_for(pipe, names, job, stale, home=home)
    async with Channel(service_urls.redis, names.tokens_channel(job.job_id)) as channel:
        await second.publish(EngineOutput(" TWO", 1, 4, 3))
        await second.publish(EngineOutput(" three", 1, 4, 4, finish_reason="stop"))
        published = await channel.chunks(2)
    assert [c.seq for c in published] == [1, 2]  # published to live listeners all the same
    after = await logged(pipe, names, job.job_id)
    assert after[:2] == before
    assert [entry_id for entry_id, _ in after] == [b"0-1", b"0-2", b"0-3"]
    assert TokenChunk.model_validate_json(after[2][1]).text == " three"
    # The rest of the script ran: the progress is done, the session's home recorded.
    assert await pipe.execute("HGET", names.job_progress(job.job_id), "done") == b"1"
    assert await pipe.execute("GET", names.affinity("s1")) == b"worker-2"


async def test_the_cap_bounds_a_runaway_log(pipe, names) -> None:
    job = job_of(max_tokens=1)
    publisher = publisher_for(pipe, names, job, Progress())
    total = 400
    for i in range(total):
        await publisher.publish(EngineOutput("x", 1, 4, i + 1, finish_reason="length" if i == total - 1 else None))
    cap = 1 + CHUNK_LOG_MARGIN
    length = await pipe.execute("XLEN", names.chunk_log(job.job_id))
    assert cap <= length <= cap + 100  # Redis trims whole nodes of (by default) 100 entries
    last = await pipe.execute("XREVRANGE", names.chunk_log(job.job_id), "+", "-", "COUNT", 1)
    assert last[0][0] == f"0-{total}".encode()  # the newest are kept


async def test_read_pages_through_the_log_in_order(pipe, names, chunk_log) -> None:
    job = job_of()
    publisher = publisher_for(pipe, names, job, Progress())
    for i in range(5):
        await publisher.publish(EngineOutput(f"t{i}", 1, 4, i + 1, finish_reason="stop" if i == 4 else None))
    assert [c.text for c in await chunk_log.read(job.job_id, -1)] == ["t0", "t1", "t2", "t3", "t4"]
    assert [c.seq for c in await chunk_log.read(job.job_id, 1, count=2)] == [2, 3]
    assert await chunk_log.read(job.job_id, 4) == []
    assert await chunk_log.read(str(uuid.uuid4()), -1) == []
    with pytest.raises(ValueError):
        await chunk_log.read(job.job_id, -1, count=0)


async def test_follow_gives_the_logged_then_the_live_chunks_and_ends_at_the_final_one(pipe, names, chunk_log) -> None:
    job = job_of()
    publisher = publisher_for(pipe, names, job, Progress())
    await publisher.publish(EngineOutput("a", 1, 4, 1))
    await publisher.publish(EngineOutput("b", 1, 4, 2))

    async def go_on() -> None:
        for i, text in enumerate(("c", "d")):
            await asyncio.sleep(0.3)  # longer than one XREAD BLOCK wait (0.2 s)
            await publisher.publish(EngineOutput(text, 1, 4, 3 + i, finish_reason="stop" if text == "d" else None))

    writer = asyncio.create_task(go_on())
    async with asyncio.timeout(5):
        followed = [c async for c in chunk_log.follow(job.job_id, 0, idle_timeout_s=2)]
    await writer
    assert [(c.seq, c.text) for c in followed] == [(1, "b"), (2, "c"), (3, "d")]
    assert followed[-1].finish_reason == "stop"


async def test_follow_times_out_when_nothing_new_is_logged(pipe, names, chunk_log) -> None:
    job = job_of()
    await publisher_for(pipe, names, job, Progress()).publish(EngineOutput("a", 1, 4, 1))
    seen: list[TokenChunk] = []
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async for chunk in chunk_log.follow(job.job_id, -1, idle_timeout_s=0.5):
            seen.append(chunk)
    assert [c.text for c in seen] == ["a"]
    assert 0.4 <= time.monotonic() - started < 2
