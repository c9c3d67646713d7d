"""Who records a job's usage row, on the real Redis: its session manager when it receives the final
chunk; the worker itself when nobody does (the session manager is gone), unless a session manager
already charged the job from its progress (`billed`). And what a job that ends early charges: an
engine failure the tokens published before it, a job cancelled while queued nothing, a job for a
LoRA adapter its worker does not serve nothing."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import orjson
import pytest

from services.worker.chunk_publisher import ChunkPublisher, UsageOwner
from services.worker.engines import EngineError, EngineOutput, GenerationRequest
from services.worker.engines.sim import SimEngine
from services.worker.failover import Failover, Progress
from services.worker.job_runner import DeadLetter, JobRunner
from services.worker.metrics import WorkerMetrics
from services.worker.redis_gate import RedisGate
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Job, Message, Sampling, TokenChunk
from shared.usage import MARK_BILLED
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
        "batch": False,
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
    published = await pipe.evalsha(MARK_BILLED, [names.job_progress(job_id)], [60])
    assert published == [b"2", b"5"]
    progress = await Failover(pipe, names, max_deliveries=3).load_progress(job_id)
    resumed = publisher_for(pipe, names, job_id, progress)
    await resumed.publish(EngineOutput(" three", 1, 5, 1, finish_reason="length"))
    assert await usage_entries(pipe, names) == []


async def test_a_queued_job_marked_billed_starts_from_the_beginning(pipe, names) -> None:
    job_id = str(uuid.uuid4())
    assert await pipe.evalsha(MARK_BILLED, [names.job_progress(job_id)], [60]) == [None, None]
    assert 0 < await pipe.execute("TTL", names.job_progress(job_id)) <= 60
    assert await Failover(pipe, names, max_deliveries=3).load_progress(job_id) == Progress()


class FailingSim(SimEngine):
    """The simulator, failing every answer after `fail_after` tokens."""

    fail_after = 4

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        count = 0
        async for out in super().generate(request):
            if count == self.fail_after:
                raise EngineError("The engine failed.")
            count += out.n_tokens
            yield out


class Delivery:
    """A RabbitMQ delivery as the job runner sees it."""

    def __init__(self, job: Job, headers: dict | None = None) -> None:
        self.body = job.model_dump_json().encode()
        self.headers: dict = headers or {}
        self.redelivered = False
        self.message_id = job.job_id
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nack(self, requeue: bool = False) -> None:
        self.settled.append("nack")


async def _nothing() -> None:
    return None


async def _not_handed_back(message: object, job: Job) -> None:
    raise AssertionError(f"{job.job_id} was handed back")


def runner_for(
    engine: SimEngine,
    pipe: RedisPipe,
    names: Names,
    *,
    dead_letter: DeadLetter,
    gate: RedisGate | None = None,
    metrics: WorkerMetrics | None = None,
) -> JobRunner:
    """A JobRunner as the worker builds one, with no broker: nothing may be handed back."""
    return JobRunner(
        engine=engine,
        pipe=pipe,
        names=names,
        metrics=metrics or WorkerMetrics(),
        max_deliveries=3,
        dead_letter=dead_letter,
        hand_back=_not_handed_back,
        gate=gate or RedisGate(pipe, on_down=lambda _reason: _nothing(), on_up=_nothing),
    )


async def run_job(
    pipe: RedisPipe, names: Names, service_urls, *, cancel_first: bool, adapter: str | None = None
) -> list[TokenChunk]:
    """Run one job on a JobRunner over the failing simulator; its chunks as published."""
    engine = FailingSim(model_name="sim-model", ttft_ms=0, itl_ms=1, max_seqs=4, context_tokens=4096)
    await engine.start()

    async def dead_letter(_message: object, _reason: str) -> None:
        raise AssertionError("nothing is dead-lettered here")

    runner = runner_for(engine, pipe, names, dead_letter=dead_letter)
    job_id = str(uuid.uuid4())
    job = Job(
        job_id=job_id,
        model="sim-model",
        messages=[Message(role="user", content="five words of prompt here")],
        sampling=Sampling(max_tokens=50),
        channel=names.tokens_channel(job_id),
        deadline=time.time() + 30,
        tenant="acme",
        key_id="key_usage",
        adapter=adapter,
    )
    if cancel_first:
        await runner.cancel(job_id)  # the client left while the job was queued
    delivery = Delivery(job)
    async with Channel(service_urls.redis, job.channel) as channel:
        await runner.on_message(delivery)
        await runner.drain(10)
        async with asyncio.timeout(5):  # until the final chunk has arrived here too
            while not channel.raw or TokenChunk.model_validate_json(channel.raw[-1]).finish_reason is None:
                await asyncio.sleep(0.01)
        chunks = [TokenChunk.model_validate_json(raw) for raw in channel.raw]
    assert delivery.settled == ["ack"]
    return chunks


async def test_job_failing_in_the_engine_is_charged_the_tokens_it_published(pipe, names, service_urls) -> None:
    chunks = await run_job(pipe, names, service_urls, cancel_first=False)
    final = chunks[-1]
    assert final.finish_reason == "error"
    assert final.usage is not None
    assert final.usage.completion_tokens == sum(c.n_tokens for c in chunks) == FailingSim.fail_after
    assert final.usage.prompt_tokens > 0
    assert await usage_entries(pipe, names) == []  # its session manager heard it


async def test_job_cancelled_while_queued_is_charged_nothing(pipe, names, service_urls) -> None:
    [final] = await run_job(pipe, names, service_urls, cancel_first=True)
    assert final.finish_reason == "cancelled"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (0, 0)


async def test_job_for_an_adapter_its_worker_lacks_fails_naming_it_and_is_charged_nothing(
    pipe, names, service_urls
) -> None:
    [final] = await run_job(pipe, names, service_urls, cancel_first=False, adapter="sql")
    assert final.finish_reason == "error"
    assert final.error is not None and final.error.type == "server_error"
    assert "adapter 'sql' of model sim-model" in final.error.message
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (0, 0)


def test_an_adapters_usage_is_owned_by_the_adapter() -> None:
    job = Job(job_id="j", model="base", adapter="sql", channel="c", deadline=0, tenant="acme", key_id="k")
    assert UsageOwner.of(job) == UsageOwner(tenant="acme", key_id="k", model="sql")
