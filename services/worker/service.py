"""The worker's job loop: take jobs from the model's queue, generate, publish chunks, ack.

A job is acked only after its final chunk is published, so a worker that dies
mid-job leaves it to be redelivered.
"""

import asyncio
import time
from collections import OrderedDict

import redis.asyncio as redis
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue
from pydantic import ValidationError

from shared.logging import bind_contextvars, clear_contextvars, get_logger
from shared.names import Names
from shared.registry import WorkerRegistry
from shared.schemas import ChunkError, FinishReason, Job, TokenChunk, Usage
from services.worker.engines import Engine, EngineError, GenerationRequest, InvalidPrompt
from services.worker.metrics import WorkerMetrics

log = get_logger(__name__)

# How many cancelled job ids to remember, so a job cancelled while still queued is skipped.
_CANCELLED_MEMORY = 10_000


class ChunkPublisher:
    """Numbers a job's chunks from 0 and publishes them on the job's channel."""

    def __init__(self, client: redis.Redis, channel: str) -> None:
        self._redis = client
        self._channel = channel
        self.seq = 0

    async def publish(self, chunk_fields: dict) -> None:
        chunk = TokenChunk(seq=self.seq, **chunk_fields)
        await self._redis.publish(self._channel, chunk.model_dump_json(exclude_none=True))
        self.seq += 1

    async def finish_with_error(self, message: str, error_type: str) -> None:
        await self.publish(
            {"finish_reason": "error", "error": ChunkError(message=message, type=error_type)}
        )


class JobRunner:
    """Runs every job delivered from the queue as its own task."""

    def __init__(
        self,
        *,
        engine: Engine,
        client: redis.Redis,
        metrics: WorkerMetrics,
    ) -> None:
        self._engine = engine
        self._redis = client
        self._metrics = metrics
        self._tasks: set[asyncio.Task] = set()
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        task = asyncio.create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel(self, job_id: str) -> None:
        """A client went away: abort its job if it runs here, skip it if it comes later."""
        self._cancelled[job_id] = None
        while len(self._cancelled) > _CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
        await self._engine.abort(job_id)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for in-flight jobs; cancel the rest (they are redelivered).

        Returns:
            How many jobs were still running at the deadline.
        """
        if not self._tasks:
            return 0
        _done, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        clear_contextvars()
        try:
            job = Job.model_validate_json(message.body)
        except ValidationError as exc:
            log.error("job_invalid", error=str(exc)[:500], message_id=message.message_id)
            await message.reject(requeue=False)
            return
        headers = message.headers or {}
        bind_contextvars(job_id=job.job_id, tenant=job.tenant, request_id=headers.get("x-request-id"))
        publisher = ChunkPublisher(self._redis, job.channel)
        started = time.perf_counter()
        try:
            outcome = await self._run(job, publisher)
        except Exception as exc:  # noqa: BLE001 - any failure must end the client's stream
            log.exception("job_crashed", error=repr(exc))
            self._metrics.jobs.labels(job.model, "crashed").inc()
            await self._fail(publisher, message)
            return
        self._metrics.jobs.labels(job.model, outcome).inc()
        await message.ack()
        log.info(
            "job_finished",
            outcome=outcome,
            chunks=publisher.seq,
            redelivered=message.redelivered,
            duration_ms=round((time.perf_counter() - started) * 1000, 1),
        )

    async def _fail(self, publisher: ChunkPublisher, message: AbstractIncomingMessage) -> None:
        """Requeue a crashed job once; a second crash dead-letters it and tells the client."""
        if not message.redelivered:
            await message.nack(requeue=True)
            return
        try:
            await publisher.finish_with_error("The worker failed while generating.", "server_error")
        finally:
            await message.reject(requeue=False)

    async def _run(self, job: Job, publisher: ChunkPublisher) -> str:
        if job.job_id in self._cancelled:
            await publisher.publish({"finish_reason": "cancelled"})
            return "cancelled"
        remaining_s = job.deadline - time.time()
        if remaining_s <= 0:
            await publisher.finish_with_error("The request's deadline passed before it started.", "timeout_error")
            return "expired"
        try:
            async with asyncio.timeout(remaining_s):
                return await self._generate(job, publisher)
        except TimeoutError:
            await self._engine.abort(job.job_id)
            await publisher.finish_with_error("The request's deadline passed during generation.", "timeout_error")
            return "expired"
        except InvalidPrompt as exc:
            await publisher.finish_with_error(str(exc), "invalid_request_error")
            return "invalid"
        except EngineError as exc:
            log.warning("job_failed", error=str(exc))
            await publisher.finish_with_error(str(exc), "server_error")
            return "error"

    async def _generate(self, job: Job, publisher: ChunkPublisher) -> str:
        request = GenerationRequest(
            request_id=job.job_id, sampling=job.sampling, messages=job.messages, prompt=job.prompt
        )
        model = job.model
        started = time.perf_counter()
        reason: FinishReason | None = None
        self._metrics.running.labels(model).inc()
        try:
            async for out in self._engine.generate(request):
                if publisher.seq == 0:
                    self._metrics.ttft.labels(model).observe(time.perf_counter() - started)
                fields: dict = {"text": out.text, "n_tokens": out.n_tokens, "finish_reason": out.finish_reason}
                if out.finish_reason is not None:
                    reason = out.finish_reason
                    fields["usage"] = Usage(
                        prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens
                    )
                    self._metrics.output_tokens.labels(model).inc(out.completion_tokens)
                    self._metrics.prompt_tokens.labels(model).inc(out.prompt_tokens)
                await publisher.publish(fields)
        finally:
            self._metrics.running.labels(model).dec()
        if reason is None:
            raise EngineError("The engine ended the answer without a finish reason.")
        self._metrics.job_duration.labels(model).observe(time.perf_counter() - started)
        return reason


class Heartbeat:
    """Keeps this worker's entry in the registry fresh while it can take jobs."""

    def __init__(self, registry: WorkerRegistry, *, worker_id: str, engine: Engine, interval_s: float, ttl_s: float) -> None:
        self._registry = registry
        self._worker_id = worker_id
        self._engine = engine
        self._interval_s = interval_s
        self._ttl_s = ttl_s

    async def run(self) -> None:
        while True:
            try:
                await self._engine.check_health()
                await self._registry.heartbeat(
                    worker_id=self._worker_id,
                    model=self._engine.model_name,
                    ttl_s=self._ttl_s,
                    max_seqs=self._engine.max_seqs,
                    context_tokens=self._engine.context_tokens,
                )
            except EngineError as exc:
                log.error("engine_unhealthy", error=str(exc))
            except Exception as exc:  # noqa: BLE001 - a failed beat must not end the loop
                log.warning("heartbeat_failed", error=repr(exc))
            await asyncio.sleep(self._interval_s)

    async def withdraw(self) -> None:
        await self._registry.remove(self._worker_id)


async def listen_for_cancellations(client: redis.Redis, names: Names, runner: JobRunner) -> None:
    """Abort jobs whose client went away, as their ids arrive on the cancel channel."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(names.cancel_channel)
    try:
        while True:
            message = await pubsub.get_message(timeout=1.0)
            if message is not None and message["type"] == "message":
                await runner.cancel(message["data"].decode())
    finally:
        await pubsub.aclose()


async def consume(queue: AbstractQueue, runner: JobRunner) -> str:
    """Start delivering jobs to `runner`; returns the consumer tag."""
    return await queue.consume(runner.on_message, no_ack=False)
