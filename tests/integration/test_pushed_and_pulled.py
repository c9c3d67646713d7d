"""A worker's sequences against the real RabbitMQ and Redis, where pushed and pulled jobs meet.

A session manager sends a job straight to the model's shared queue (pushed to a worker) when
nothing waits and a worker reported a free sequence, which it reserves; the worker's puller may
fill that sequence from the tenants' queues before the pushed job arrives. The pushed job then
waits in the worker for the next sequence to free: the engine never runs more than its sequences,
and the fair share's headroom stays for a tenant with nothing running there."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aio_pika.abc import AbstractQueue, AbstractRobustConnection

from services.sessions.job_publishing import JobPublisher
from services.worker.engines import EngineOutput, GenerationRequest
from services.worker.engines.sim import SimEngine
from services.worker.job_runner import JobRunner, consume
from services.worker.metrics import WorkerMetrics
from services.worker.pulling import Puller
from services.worker.redis_gate import RedisGate
from shared.clients import connect_amqp
from shared.fair import INTERACTIVE, FairShare
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Job, Message, Sampling
from shared.topology import declare_batch_queue, declare_job_queue

MODEL = "sim-pushed"
WORKER = "worker-pushed"


class Recording(SimEngine):
    """The simulator, noting when each answer starts and ends."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.spans: dict[str, list[float]] = {}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        span = self.spans[request.request_id] = [time.monotonic()]
        try:
            async for out in super().generate(request):
                yield out
        finally:
            span.append(time.monotonic())

    def most_at_once(self) -> int:
        edges = sorted([(s[0], 1) for s in self.spans.values()] + [(s[1], -1) for s in self.spans.values()])
        most = running = 0
        for _at, step in edges:
            running += step
            most = max(most, running)
        return most


@dataclass
class Worker:
    engine: Recording
    runner: JobRunner
    puller: Puller
    queue: AbstractQueue
    publisher: JobPublisher
    fair: FairShare
    names: Names


async def _nothing() -> None:
    return None


async def _refuse(message: object, *_args: object) -> None:
    raise AssertionError(f"not expected here: {message!r}")


@pytest.fixture
async def worker(namespace: str, service_urls) -> AsyncIterator[Worker]:
    """A worker of two sequences and a headroom of one, not consuming its queue yet, and a session
    manager's publisher, on a namespace of their own."""
    names = Names(f"{namespace}-pushed-{uuid.uuid4().hex[:6]}")
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    fair = FairShare(pipe, names)
    engine = Recording(model_name=MODEL, ttft_ms=0, itl_ms=25, max_seqs=2, context_tokens=4096)
    await engine.start()
    connection: AbstractRobustConnection = await connect_amqp(service_urls.amqp, timeout_s=5)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=engine.max_seqs, global_=True)
    queue = await declare_job_queue(channel, names, MODEL, max_queued_jobs=16)
    runner = JobRunner(
        engine=engine,
        pipe=pipe,
        names=names,
        metrics=WorkerMetrics(),
        max_deliveries=3,
        dead_letter=_refuse,
        hand_back=_refuse,
        gate=RedisGate(pipe, on_down=lambda _reason: _nothing(), on_up=_nothing),
        worker_id=WORKER,
        headroom=1,
    )
    puller = Puller(
        runner,
        connection,
        names,
        model=MODEL,
        worker_id=WORKER,
        fair=fair,
        batch_queue=await declare_batch_queue(await connection.channel(), names, MODEL, max_queued_jobs=16),
        doorbell=asyncio.Event(),
        timeout_s=5,
        reserved=0,
        headroom=1,
        max_queued_jobs=16,
    )
    publisher = JobPublisher(connection, names, max_queued_jobs=16, publish_timeout_s=5, fair=fair)
    await publisher.start()
    yield Worker(engine, runner, puller, queue, publisher, fair, names)
    await puller.pause()
    await runner.drain(5)
    cleanup = await connection.channel()
    for name in [names.jobs_queue(MODEL), names.batch_queue(MODEL), names.dead_letter_queue]:
        await cleanup.queue_delete(name)
    for tenant in ("acme", "newco"):
        await cleanup.queue_delete(names.tenant_queue(MODEL, tenant, batch=False))
    await connection.close()
    await engine.stop()
    await pipe.aclose()


def job(names: Names, tenant: str) -> Job:
    job_id = f"{tenant}-{uuid.uuid4().hex[:8]}"
    return Job(
        job_id=job_id,
        model=MODEL,
        messages=[Message(role="user", content="tell me everything")],
        sampling=Sampling(max_tokens=24, seed=1),  # 0.6 s: the pulled ones still run when the pushed one comes
        channel=names.tokens_channel(job_id),
        deadline=time.time() + 60,
        tenant=tenant,
        key_id="key_pushed",
        chunk_log_ttl_s=60,  # runs on with nobody subscribed
    )


async def until(condition, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def fill_by_pulls(w: Worker, tenant: str) -> list[Job]:
    """Two jobs of `tenant` waiting in its queue, pulled into the worker's two sequences."""
    pulled = [job(w.names, tenant) for _ in range(2)]
    for each in pulled:
        assert await w.publisher.publish(each, priority=0, request_id=each.job_id) == "tenant"
    w.puller.resume()
    await until(lambda: all(each.job_id in w.engine.spans for each in pulled))
    return pulled


async def test_a_pushed_job_whose_sequence_was_pulled_meanwhile_waits_for_the_next(worker: Worker) -> None:
    w = worker
    await w.fair.report_free(MODEL, WORKER, 1, valid_ms=5000)
    # Nothing waits and the worker said a sequence is free: the job takes it, through the shared queue.
    pushed = job(w.names, "acme")
    assert await w.publisher.publish(pushed, priority=0, request_id=pushed.job_id) == "shared"
    # The next ones find it reserved and wait in their tenant's queue; the puller, which cannot tell
    # a reserved sequence from an unclaimed one, takes them into both sequences first.
    pulled = await fill_by_pulls(w, "acme")
    await consume(w.queue, w.runner)  # the pushed job arrives at a worker with every sequence taken
    await until(lambda: w.runner.in_flight == 3)
    assert w.runner.running == 2 and pushed.job_id not in w.engine.spans
    assert await w.fair.waiting(MODEL, "acme", band=INTERACTIVE) == 0
    await until(lambda: len(w.engine.spans) == 3 and all(len(s) == 2 for s in w.engine.spans.values()))
    assert w.engine.most_at_once() == 2
    # It started as the first pulled one ended.
    first_end = min(w.engine.spans[each.job_id][1] for each in pulled)
    assert 0 <= w.engine.spans[pushed.job_id][0] - first_end < 0.5


async def test_the_headroom_starts_a_pushed_job_of_a_tenant_with_none_running_and_drain_gives_back_the_held(
    worker: Worker,
) -> None:
    w = worker
    await w.fair.report_free(MODEL, WORKER, 2, valid_ms=5000)
    held, newcomer = job(w.names, "acme"), job(w.names, "newco")
    for each in (held, newcomer):
        assert await w.publisher.publish(each, priority=0, request_id=each.job_id) == "shared"
    await fill_by_pulls(w, "acme")
    tag = await consume(w.queue, w.runner)
    await until(lambda: newcomer.job_id in w.engine.spans and w.runner.in_flight == 4)
    # acme has jobs running: its pushed one waits; newco had none: it runs beside them, in the headroom.
    assert held.job_id not in w.engine.spans and w.runner.running == 3
    assert w.runner.tenants_running == {"acme", "newco"}
    await w.queue.cancel(tag)
    assert await w.runner.drain(10) == 1
    assert held.job_id not in w.engine.spans
    channel = await w.queue.channel.get_underlay_channel()
    assert (await channel.queue_declare(w.names.jobs_queue(MODEL), passive=True)).message_count == 1
