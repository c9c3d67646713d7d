"""The job runner against the real Redis: a job cut off from Redis waits for it and finishes on the
same delivery, uncounted."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from services.worker.engines.sim import SimEngine
from services.worker.job_runner import JobRunner
from services.worker.metrics import WorkerMetrics
from services.worker.redis_gate import RedisGate
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Job, Message, Sampling
from tests.e2e.tcpproxy import TcpProxy
from tests.integration.test_chunks import Channel
from tests.integration.test_usage_rows import Delivery, runner_for

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


def job_for(names: Names, *, max_tokens: int) -> Job:
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
    )


async def no_dead_letter(_message: object, reason: str) -> None:
    raise AssertionError(f"dead-lettered: {reason}")


def count(metrics: WorkerMetrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("axon_worker_jobs_total", {"model": MODEL, "outcome": outcome}) or 0.0


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
            assert not gate.up and calls and calls[0].startswith("down: ConnectionError")
            assert len(channel.raw) == cut_at_seq and delivery.settled == []  # waiting, not requeued
            proxy.restore()
            await running
            chunks = {chunk.seq: chunk for chunk in await channel.chunks(1)}
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
