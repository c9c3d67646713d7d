"""The job runner against the real Redis: a job cut off from Redis waits for it and finishes on the
same delivery, uncounted; a job nobody reads any more stops within a step and is charged; one that
keeps a chunk log runs on without listeners; a job handed back at shutdown is not counted against,
and is dropped at once when nobody reads it any more."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from services.worker.chunk_publisher import ChunkPublisher, UsageOwner
from services.worker.engines import EngineOutput
from services.worker.engines.sim import SimEngine
from services.worker.failover import Progress
from services.worker.job_runner import JobRunner
from services.worker.metrics import WorkerMetrics
from services.worker.redis_gate import RedisGate
from shared.internal_headers import HANDED_BACK_HEADER
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Job, Message, Sampling, TokenChunk
from tests.e2e.tcpproxy import TcpProxy
from tests.integration.test_chunks import Channel
from tests.integration.test_usage_rows import Delivery, runner_for, usage_entries

MODEL = "sim-model"


@pytest.fixture
def names(namespace: str) -> Names:
    return Names(f"{namespace}-outages-{uuid.uuid4().hex[:8]}")  # an outbox no persister reads


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    engine = SimEngine(model_name=MODEL, ttft_ms=0, itl_ms=5, max_seqs=4, context_tokens=4096)
    await engine.start()
    yield engine
    await engine.stop()


def job_for(names: Names, *, max_tokens: int, chunk_log_ttl_s: int | None = None) -> Job:
    job_id = str(uuid.uuid4())
    return Job(
        job_id=job_id,
        model=MODEL,
        messages=[Message(role="user", content="tell me everything")],
        sampling=Sampling(max_tokens=max_tokens, seed=1),
        channel=names.tokens_channel(job_id),
        deadline=time.time() + 60,
        tenant="acme",
        key_id="key_outages",
        chunk_log_ttl_s=chunk_log_ttl_s,
    )


async def no_dead_letter(_message: object, reason: str) -> None:
    raise AssertionError(f"dead-lettered: {reason}")


def count(metrics: WorkerMetrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("axon_worker_jobs_total", {"model": MODEL, "outcome": outcome}) or 0.0


async def until_final(channel: Channel) -> list[TokenChunk]:
    """The channel's chunks once the final one has arrived here too (pub/sub delivers it after the
    job's task ended)."""
    async with asyncio.timeout(5):
        while True:
            chunks = await channel.chunks(1)
            if any(chunk.finish_reason is not None for chunk in chunks):
                return chunks
            await asyncio.sleep(0.01)


async def run(runner: JobRunner, delivery: Delivery, timeout_s: float = 10) -> float:
    """Deliver one job and wait until its task ends; returns how long it took."""
    started = time.monotonic()
    await runner.on_message(delivery)
    assert await runner.drain(timeout_s) == 0
    return time.monotonic() - started


async def test_a_job_cut_off_from_redis_waits_for_it_and_finishes_on_the_same_delivery(
    engine, names, service_urls
) -> None:
    proxy = TcpProxy.to(service_urls.redis)
    pipe = RedisPipe(proxy.proxied(service_urls.redis), timeout_s=2)
    calls: list[str] = []

    async def on_down(reason: str) -> None:
        calls.append(f"down: {reason}")

    async def on_up() -> None:
        calls.append("up")

    gate = RedisGate(pipe, on_down=on_down, on_up=on_up)
    metrics = WorkerMetrics()
    runner = runner_for(engine, pipe, names, dead_letter=no_dead_letter, gate=gate, metrics=metrics)
    job = job_for(names, max_tokens=200)
    delivery = Delivery(job)
    try:
        async with Channel(service_urls.redis, job.channel) as channel:
            running = asyncio.create_task(run(runner, delivery, timeout_s=30))
            await channel.chunks(20)
            proxy.cut()
            await asyncio.sleep(1)
            cut_at_seq = len(channel.raw)
            # Down, naming Redis's address (a connection refused, or lost with a command in flight).
            assert not gate.up and len(calls) == 1 and f"127.0.0.1:{proxy.port}" in calls[0]
            assert len(channel.raw) == cut_at_seq and delivery.settled == []  # waiting, not requeued
            proxy.restore()
            await running
            chunks = {chunk.seq: chunk for chunk in await until_final(channel)}
    finally:
        await gate.close()
        await pipe.aclose()
        proxy.close()
    assert calls[-1] == "up"
    assert delivery.settled == ["ack"]
    # Every seq once (the relay keeps the first of each), the answer whole.
    assert sorted(chunks) == list(range(len(chunks)))
    final = chunks[len(chunks) - 1]
    assert final.finish_reason == "length" and final.usage is not None and final.usage.completion_tokens == 200
    assert sum(c.n_tokens for c in chunks.values()) == 200
    assert (count(metrics, "completed"), count(metrics, "resumed"), count(metrics, "failed")) == (1, 1, 0)
    redis = RedisPipe(service_urls.redis, timeout_s=2)
    try:
        assert await redis.execute("EXISTS", names.job_deliveries(job.job_id)) == 0  # no delivery counted
    finally:
        await redis.aclose()


async def test_a_job_nobody_reads_stops_within_a_step_and_its_worker_records_its_usage(
    engine, names, service_urls
) -> None:
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    metrics = WorkerMetrics()
    runner = runner_for(engine, pipe, names, dead_letter=no_dead_letter, metrics=metrics)
    job = job_for(names, max_tokens=2000)  # 10 s of tokens
    delivery = Delivery(job)
    try:
        took_s = await run(runner, delivery)
        [row] = await usage_entries(pipe, names)
    finally:
        await pipe.aclose()
    assert took_s < 1
    assert delivery.settled == ["ack"] and count(metrics, "unheard") == 1
    assert (row["tenant"], row["key_id"]) == ("acme", "key_outages")
    # Charged what it generated until the first publish came back unheard: a token every 5 ms for
    # that round trip, a few on an idle machine, more on a busy one; far short of the 2,000.
    assert 1 <= row["completion_tokens"] <= 100


async def test_a_job_with_a_chunk_log_runs_on_with_nobody_listening(engine, names, service_urls) -> None:
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    metrics = WorkerMetrics()
    runner = runner_for(engine, pipe, names, dead_letter=no_dead_letter, metrics=metrics)
    job = job_for(names, max_tokens=40, chunk_log_ttl_s=60)
    try:
        await run(runner, Delivery(job))
        logged = await pipe.execute("XRANGE", names.chunk_log(job.job_id), "-", "+")
    finally:
        await pipe.aclose()
    chunks = [TokenChunk.model_validate_json(fields[1]) for _id, fields in logged]
    assert chunks[-1].finish_reason == "length" and sum(c.n_tokens for c in chunks) == 40
    assert count(metrics, "completed") == 1 and count(metrics, "unheard") == 0


async def _started_elsewhere(pipe: RedisPipe, names: Names, job: Job) -> None:
    """Two chunks published by a worker that then handed the job back."""
    publisher = ChunkPublisher(
        pipe,
        names,
        job_id=job.job_id,
        channel=job.channel,
        deadline=job.deadline,
        progress=Progress(),
        owner=UsageOwner.of(job),
    )
    await publisher.publish(EngineOutput("One", 1, 3, 1, token_ids=(1,)))
    await publisher.publish(EngineOutput(" two", 1, 3, 2, token_ids=(2,)))


async def test_a_handed_back_job_is_resumed_uncounted_or_dropped_at_once_when_nobody_reads_it(
    engine, names, service_urls
) -> None:
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    metrics = WorkerMetrics()
    runner = runner_for(engine, pipe, names, dead_letter=no_dead_letter, metrics=metrics)
    handed_back = {HANDED_BACK_HEADER: "worker-gone"}
    read, unread = job_for(names, max_tokens=20), job_for(names, max_tokens=2000)
    try:
        for job in (read, unread):
            await _started_elsewhere(pipe, names, job)
        async with Channel(service_urls.redis, read.channel) as channel:
            await run(runner, Delivery(read, headers=handed_back))
            resumed = await until_final(channel)
        took_s = await run(runner, Delivery(unread, headers=handed_back))
        [row] = await usage_entries(pipe, names)
        counted = await pipe.execute("EXISTS", names.job_deliveries(read.job_id), names.job_deliveries(unread.job_id))
    finally:
        await pipe.aclose()
    # Resumed where it stopped, to its end.
    assert resumed[0].seq == 2 and resumed[-1].usage is not None and resumed[-1].usage.completion_tokens == 20
    # Nobody reads the other: ended without generating, its two published tokens charged.
    assert took_s < 2
    assert (row["completion_tokens"], row["prompt_tokens"]) == (2, 3)
    # Both went on from the other worker's progress (the second only to end it, numbered and charged on).
    assert (count(metrics, "completed"), count(metrics, "resumed"), count(metrics, "unheard")) == (1, 2, 1)
    assert counted == 0  # neither delivery counted against its job
