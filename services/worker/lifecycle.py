"""Everything one worker process runs, from boot (engine, connections, consumer) through drain to
shutdown."""

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection

from services.worker.engines import Engine
from services.worker.heartbeat import Heartbeat
from services.worker.job_runner import JobRunner, consume, listen_for_cancellations
from services.worker.kv_index import KvIndex
from services.worker.metrics import KvIndexMetrics, WorkerMetrics
from services.worker.pulling import Puller, listen_for_doorbell
from services.worker.redis_gate import RedisGate
from services.worker.settings import WorkerSettings
from shared.clients import connect_amqp, create_redis
from shared.fair import FairShare, ServiceMeter
from shared.internal_headers import DEAD_REASON_HEADER, HANDED_BACK_HEADER
from shared.logging import get_logger
from shared.names import Names
from shared.outages import Outage, describe
from shared.redis_pipe import RedisPipe
from shared.registry import WorkerRegistry
from shared.schemas import Job
from shared.topology import declare_batch_queue, declare_job_queue, declare_worker_queue
from shared.tracing import Tracing

log = get_logger(__name__)

# RabbitMQ's own header on a dead-lettered message: a handed-back job's copy leaves it out.
_DEATH_HEADER = "x-death"


class Worker:
    """Everything one worker process runs, started in the background so `/health` answers at once."""

    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.names = Names(settings.namespace)
        self.metrics = WorkerMetrics()
        self.tracing = Tracing.of(
            settings, service="axon-worker", registry=self.metrics.registry, instance_id=settings.worker_id
        )
        self.redis = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
        # Every chunk's publish script, batched per loop iteration across the jobs running here.
        self.pipe = RedisPipe(settings.redis_url, timeout_s=settings.connect_timeout_s)
        self.registry = WorkerRegistry(self.redis, self.names)
        # While Redis is unreachable the worker takes no job and is not ready (`redis_gate.py`).
        self.gate = RedisGate(self.pipe, on_down=self._pause, on_up=self._resume)
        self.fair = FairShare(self.pipe, self.names)
        self.meter = ServiceMeter(
            self.fair, prompt_cost=settings.fair_prompt_token_cost, output_cost=settings.fair_output_token_cost
        )
        # Rung by session managers when a job of the model waits in a tenant's queue.
        self._doorbell = asyncio.Event()
        self.runner = JobRunner(
            engine=engine,
            pipe=self.pipe,
            names=self.names,
            metrics=self.metrics,
            max_deliveries=settings.max_deliveries,
            dead_letter=self._dead_letter,
            hand_back=self.hand_back,
            gate=self.gate,
            worker_id=settings.worker_id,
            on_engine_failure=self.fail,
            tracing=self.tracing,
            meter=self.meter,
            headroom=settings.fair_headroom_seqs,
        )
        self.not_ready_reason: str | None = "starting"
        # Why the process must exit non-zero (the engine failed), so an orchestrator restarts it.
        self.fatal: str | None = None
        self._drained = False
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        # The model's shared queue and this worker's own (sessions whose last turn it served).
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._own_queue: AbstractQueue | None = None
        self._own_consumer_tag: str | None = None
        # Takes the tenants' waiting jobs and batch lines into free sequences, on channels of its own.
        self._puller: Puller | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._engine_starting: asyncio.Future[None] | None = None
        # What `/ready` says while Redis is unreachable (None: it is not).
        self._redis_reason: str | None = None
        self._consuming = asyncio.Lock()
        # This worker's part of the prefix index, when its engine publishes KV-cache events.
        self.kv_index: KvIndex | None = None

    def _start_kv_index(self) -> list[asyncio.Task[None]]:
        """Follow the engine's KV-cache events into the prefix index (`kv_index.py`), if it
        publishes them and the index is on; returns the tasks doing it."""
        source = self.engine.kv_events() if self.settings.prefix_index else None
        if source is None or not self.engine.kv_block_size:
            return []
        model = self.engine.model_name
        index = KvIndex(
            self.pipe,
            self.names,
            model=model,
            worker_id=self.settings.worker_id,
            block_size=self.engine.kv_block_size,
            max_pending=self.settings.prefix_index_pending_anchors,
            metrics=KvIndexMetrics(self.metrics, model),
        )
        self.kv_index = index
        self.engine.prompt_observer = index.observe
        log.info("prefix_index_started", block_size=self.engine.kv_block_size)
        return [asyncio.create_task(index.follow(source)), asyncio.create_task(index.keep_written())]

    async def boot(self) -> None:
        """Load the engine, then connect and start consuming. A broken engine stops the process."""
        self.not_ready_reason = "loading model"
        # Shielded: a stop while the model loads must not leave a half-started engine running
        # (its threads would keep the process alive); `shutdown` waits for the load, then stops it.
        self._engine_starting = asyncio.ensure_future(self.engine.start())
        try:
            await asyncio.shield(self._engine_starting)
        except Exception as exc:
            log.exception("engine_start_failed", error=str(exc))
            self.fail(f"engine failed to start: {exc}")
            return
        self.metrics.observe_engine(
            model=self.engine.model_name,
            max_seqs=self.engine.max_seqs,
            in_flight=lambda: self.runner.in_flight,
            generating=lambda: self.runner.generating,
            batch=lambda: self.runner.batch_in_flight,
            kv_cache_usage=self.engine.kv_cache_usage if self.engine.reports_kv_cache else None,
        )
        self.metrics.include(self.engine.metrics)
        self._tasks += self._start_kv_index()
        await self._connect_until_up()
        if self._drained:
            return
        heartbeat = Heartbeat(
            self.registry,
            worker_id=self.settings.worker_id,
            engine=self.engine,
            interval_s=self.settings.heartbeat_interval_s,
            ttl_s=self.settings.heartbeat_ttl_s,
            on_engine_failure=self.fail,
            gate=self.gate,
            prefix_index=self.kv_index is not None,
        )
        self.meter.start()
        self._tasks += [
            asyncio.create_task(heartbeat.run()),
            asyncio.create_task(
                listen_for_doorbell(
                    self.settings.redis_url,
                    self.names.fair_ready(self.engine.model_name),
                    self._doorbell,
                    self.gate,
                    timeout_s=self.settings.connect_timeout_s,
                )
            ),
            asyncio.create_task(
                listen_for_cancellations(
                    self.settings.redis_url,
                    self.names,
                    self.runner,
                    self.gate,
                    timeout_s=self.settings.connect_timeout_s,
                )
            ),
        ]
        self._heartbeat = heartbeat
        self.not_ready_reason = self._redis_reason
        log.info(
            "worker_ready",
            model=self.engine.model_name,
            max_seqs=self.engine.max_seqs,
            adapters=sorted(self.engine.adapters),
        )

    def fail(self, reason: str) -> None:
        """Stop serving and exit non-zero: the engine cannot be trusted any more. Once: each
        further signal would count towards forcing the stop."""
        if self.fatal is not None:
            return
        self.fatal = reason
        self.not_ready_reason = f"engine failed: {reason}"
        os.kill(os.getpid(), signal.SIGTERM)

    async def _dead_letter(self, message: AbstractIncomingMessage, reason: str) -> None:
        """Move a job to the dead-letter queue with the reason in its headers."""
        assert self._channel is not None
        exchange = await self._channel.get_exchange(self.names.dead_letter_exchange, ensure=False)
        await exchange.publish(
            aio_pika.Message(
                body=message.body,
                headers={**(message.headers or {}), DEAD_REASON_HEADER: reason},
                message_id=message.message_id,
                content_type=message.content_type,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key="",
        )
        await message.ack()

    async def hand_back(self, message: AbstractIncomingMessage, job: Job) -> None:
        """Give an unfinished job back to its model's queue for another worker, saying so: a copy
        with `HANDED_BACK_HEADER` (the next worker reads its progress back, checks that someone
        still reads its answer, and does not count the delivery against it) expiring at its
        deadline, then the delivery acked. If the copy cannot be published, the delivery is nacked
        back to the queue instead (a plain redelivery)."""
        headers = {k: v for k, v in (message.headers or {}).items() if k != _DEATH_HEADER}
        # A batch line's job goes back to the batch queue (it was taken from there, or preempted).
        routing_key = self.names.batch_queue(job.model) if job.batch else job.model
        copy = aio_pika.Message(
            body=message.body,
            headers={**headers, HANDED_BACK_HEADER: self.settings.worker_id},
            message_id=message.message_id,
            content_type=message.content_type,
            priority=message.priority,
            expiration=max(0.001, job.deadline - time.time()),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        try:
            assert self._channel is not None
            exchange = await self._channel.get_exchange(self.names.jobs_exchange, ensure=False)
            confirmation = await exchange.publish(
                copy, routing_key=routing_key, mandatory=True, timeout=self.settings.connect_timeout_s
            )
            if isinstance(confirmation, aiormq.spec.Basic.Ack):
                await message.ack()
                return
            log.warning("job_hand_back_failed", error="the job's queue did not take it")
        except Exception as exc:  # noqa: BLE001 - nacked back instead
            log.warning("job_hand_back_failed", error=repr(exc))
        with contextlib.suppress(Exception):
            await message.nack(requeue=True)

    async def _pause(self, reason: str) -> None:
        """Redis is unreachable: take no more jobs (those in hand wait for it) and say why on `/ready`."""
        self._redis_reason = f"Redis unreachable: {reason}"
        if self.not_ready_reason is None:
            self.not_ready_reason = self._redis_reason
        await self._stop_taking()

    async def _resume(self) -> None:
        """Redis answers again: ready, and taking jobs again (retried while the broker refuses)."""
        if self.not_ready_reason == self._redis_reason:
            self.not_ready_reason = None
        self._redis_reason = None
        outage = Outage("worker_consume")
        while not self._drained and self._redis_reason is None:
            try:
                async with self._consuming:
                    await self._consume()
                outage.recovered()
                return
            except Exception as exc:  # noqa: BLE001 - the broker is away: consume once it is back
                await asyncio.sleep(outage.failed(exc))

    async def _consume(self) -> None:
        """Consume the worker's own queue and its model's (those not consumed yet)."""
        if self._drained or self._own_queue is None or self._queue is None:
            return
        if self._own_consumer_tag is None:
            self._own_consumer_tag = await consume(self._own_queue, self.runner)
        if self._consumer_tag is None:
            self._consumer_tag = await consume(self._queue, self.runner)
        if self._puller is not None:
            self._puller.resume()

    async def _connect_until_up(self) -> None:
        outage = Outage("worker_connect")
        while not self._drained:  # a stop requested while booting: take no job at all
            try:
                await self.redis.ping()
                self._connection = await connect_amqp(self.settings.amqp_url, timeout_s=self.settings.connect_timeout_s)
                self._channel = await self._connection.channel()
                # One limit for both queues' consumers (`global_`: per channel, not per consumer),
                # so the worker never holds more than `max_seqs` jobs, whichever queue they came from.
                await self._channel.set_qos(prefetch_count=self.engine.max_seqs, global_=True)
                self._queue = await declare_job_queue(
                    self._channel,
                    self.names,
                    self.engine.model_name,
                    max_queued_jobs=self.settings.max_queued_jobs,
                )
                self._own_queue = await declare_worker_queue(
                    self._channel, self.names, self.engine.model_name, self.settings.worker_id
                )
                batch_queue = await declare_batch_queue(
                    await self._connection.channel(),
                    self.names,
                    self.engine.model_name,
                    max_queued_jobs=self.settings.max_queued_jobs,
                )
                self._puller = Puller(
                    self.runner,
                    self._connection,
                    self.names,
                    model=self.engine.model_name,
                    worker_id=self.settings.worker_id,
                    fair=self.fair,
                    batch_queue=batch_queue,
                    doorbell=self._doorbell,
                    timeout_s=self.settings.connect_timeout_s,
                    reserved=self.settings.batch_reserved_seqs,
                    headroom=self.settings.fair_headroom_seqs,
                    max_queued_jobs=self.settings.max_queued_jobs,
                )
                async with self._consuming:
                    await self._consume()
                outage.recovered()
                return
            except Exception as exc:  # noqa: BLE001 - report and retry, never crash-loop
                self.not_ready_reason = f"dependencies unreachable: {describe(exc)}"
                if self._connection is not None:
                    with contextlib.suppress(Exception):
                        await self._connection.close()
                    self._connection = None
                await asyncio.sleep(outage.failed(exc))

    async def drain(self) -> None:
        """Stop taking jobs (readiness goes false), let in-flight ones finish within
        `drain_timeout_s`, hand the rest back to the queue. Runs once."""
        if self._drained:
            return
        self._drained = True
        self.not_ready_reason = "shutting down"
        # Its own queue's consumer stops too: what waits there (and what session managers still send
        # before they see the draining heartbeat) expires into the shared queue within the affinity wait.
        await self._stop_taking()
        if self.kv_index is not None:
            await self.kv_index.withdraw()
        if getattr(self, "_heartbeat", None) is not None:
            await self._heartbeat.draining()
        left = await self.runner.drain(self.settings.drain_timeout_s)
        log.info("worker_drained", handed_back=left)

    async def _stop_taking(self) -> None:
        """Cancel both consumers and pause the puller, together. A broker away (for good, maybe) is
        not waited for: it cannot be told, and its channel's close cancels the consumers and gives
        back what they held anyway; a live one gets the connect timeout to answer a cancel."""

        async def cancel(queue: AbstractQueue, tag: str) -> None:
            if self._connection is None or not self._connection.connected.is_set():
                return  # the broker is away: nothing to tell it
            with contextlib.suppress(Exception):
                await asyncio.wait_for(queue.cancel(tag), self.settings.connect_timeout_s)

        async with self._consuming:
            steps = [
                cancel(queue, tag)
                for queue, tag in ((self._own_queue, self._own_consumer_tag), (self._queue, self._consumer_tag))
                if queue is not None and tag is not None
            ]
            if self._puller is not None:
                steps.append(self._puller.pause())
            await asyncio.gather(*steps)
            self._own_consumer_tag = self._consumer_tag = None

    async def shutdown(self) -> None:
        """Drain, withdraw from the registry, release everything."""
        await self.drain()
        if getattr(self, "_heartbeat", None) is not None:
            with contextlib.suppress(Exception):
                await self._heartbeat.withdraw()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.meter.stop()
        await self.gate.close()
        if self._connection is not None:
            await self._connection.close()  # unacked jobs go back to the queue
        if self._engine_starting is not None and not self._engine_starting.done():
            log.info("waiting_for_model_load", reason="stopping while the model loads")
            await asyncio.gather(self._engine_starting, return_exceptions=True)
        await self.engine.stop()
        await self.pipe.aclose()
        await self.redis.aclose()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Boot in the background while the block runs, then shut down."""
        boot = asyncio.create_task(self.boot())
        try:
            yield
        finally:
            boot.cancel()
            await asyncio.gather(boot, return_exceptions=True)
            await self.shutdown()
            if self.tracing is not None:
                await asyncio.to_thread(self.tracing.shutdown)
