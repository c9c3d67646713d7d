"""The worker's job loop: take jobs from the model's queue, generate, publish chunks, ack.

A job is acked only after its final chunk is published, so a worker that dies
mid-job leaves it to be redelivered. A job that finds Redis unreachable waits for it at the
worker's `RedisGate` and is tried again on the same delivery; a job whose answer nobody can read
any more (no subscriber on its channel, no chunk log) is stopped within a step.
"""

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue
from aio_pika.exceptions import AMQPError
from aiormq.exceptions import ChannelInvalidStateError
from pydantic import ValidationError

from services.worker.chunk_publisher import ChunkLogTarget, ChunkPublisher, Coalescer, Home, UsageOwner
from services.worker.constraints import guide_for
from services.worker.engines import (
    Engine,
    EngineDied,
    EngineError,
    EngineOutput,
    EngineStopped,
    GenerationRequest,
    InvalidPrompt,
    Resume,
)
from services.worker.failover import Failover, Progress, remaining_sampling
from services.worker.metrics import WorkerMetrics
from services.worker.redis_gate import RedisGate
from services.worker.tool_parsers import answer_finish_reason
from shared.fair import BATCH, INTERACTIVE, ServiceMeter
from shared.internal_headers import ENQUEUED_AT_HEADER, HANDED_BACK_HEADER
from shared.logging import bind_contextvars, clear_contextvars, get_logger
from shared.names import Names
from shared.outages import Outage, redis_unreachable
from shared.redis_pipe import RedisPipe, RedisSubscriber
from shared.schemas import FinishReason, Job
from shared.topology import spilled_from_worker_queue
from shared.tracing import (
    PUBLISHED_AT_HEADER,
    SpanKind,
    Tracing,
    annotate,
    context_from,
    current_traceparent,
    exemplar,
    span,
)

log = get_logger(__name__)

# Outcomes whose job span is marked as an error (a trace a collector's tail sampling keeps).
_FAILED = frozenset({"failed", "expired"})
# How many cancelled job ids to remember, so a job cancelled while still queued is skipped.
_CANCELLED_MEMORY = 10_000
# A batch line's answer is published at most this often (its tokens merged meanwhile): nobody
# streams it, and each chunk costs the worker, Redis and the session manager as an interactive
# one's. A preempted line resumes from what was published, so it loses at most this much work.
BATCH_CHUNK_INTERVAL_S = 0.5


DeadLetter = Callable[[AbstractIncomingMessage, str], Awaitable[None]]
# Gives an unfinished job back to the queue for another worker (`Worker.hand_back`).
HandBack = Callable[[AbstractIncomingMessage, Job], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Attempt:
    """How one attempt at a job starts: whether earlier attempts may have published some of it
    (`retried`: its progress is read back first, and whether anyone still reads it), and whether
    this delivery counts against the job's `max_deliveries` (`counted`: RabbitMQ redelivered it,
    so a worker died with it or it crashed one; or, with `counted_if_started`, it has progress
    from a worker that died with it before it expired out of that worker's queue)."""

    retried: bool
    counted: bool
    counted_if_started: bool

    @classmethod
    def first(cls, message: AbstractIncomingMessage) -> "Attempt":
        headers = message.headers or {}
        # Handed back at shutdown (`Worker.hand_back`): republished, not redelivered, and no
        # worker's fault. A job that expired out of a worker's own queue may have been delivered
        # there before (its worker died), but RabbitMQ delivers it here as a new message.
        handed_back = HANDED_BACK_HEADER in headers
        return cls(
            retried=message.redelivered or handed_back or spilled_from_worker_queue(headers),
            counted=bool(message.redelivered),
            counted_if_started=not handed_back,
        )


# An attempt after an outage: the same delivery, tried again from its progress, not counted.
_AFTER_OUTAGE = Attempt(retried=True, counted=False, counted_if_started=False)


class JobRunner:
    """Runs every job delivered from the queue as its own task."""

    def __init__(
        self,
        *,
        engine: Engine,
        pipe: RedisPipe,
        names: Names,
        metrics: WorkerMetrics,
        max_deliveries: int,
        dead_letter: DeadLetter,
        hand_back: HandBack,
        gate: RedisGate,
        worker_id: str = "",
        on_engine_failure: Callable[[str], None] | None = None,
        tracing: Tracing | None = None,
        meter: ServiceMeter | None = None,
        headroom: int = 0,
    ) -> None:
        self._engine = engine
        # Sequences past the engine's for a tenant with no job running here (the fair share's
        # headroom, `AXON_FAIR_HEADROOM_SEQS`).
        self._headroom = headroom
        # Counts the tokens each tenant is served, for the fair share (None: not counted).
        self._meter = meter
        self._tracing = tracing
        # Called when the engine died under a job: the worker stops (`Worker.fail`).
        self._on_engine_failure = on_engine_failure
        # Named as a session's home by its answers (none: this runner records no affinity).
        self._worker_id = worker_id
        self._pipe = pipe
        self._names = names
        self._metrics = metrics
        self._failover = Failover(pipe, names, max_deliveries=max_deliveries)
        self._max_deliveries = max_deliveries
        self._dead_letter = dead_letter
        self._hand_back = hand_back
        self._gate = gate
        self._tasks: set[asyncio.Task[None]] = set()
        # The batch lines' jobs among them, oldest first, and those preempted (being handed back).
        self._batch: dict[asyncio.Task[None], None] = {}
        self._preempted: set[asyncio.Task[None]] = set()
        # Jobs pushed while every sequence was taken, oldest first: each starts as the next one
        # frees, ahead of anything pulled (see `on_message`).
        self._held: deque[tuple[AbstractIncomingMessage, str | None]] = deque()
        self._freed = asyncio.Event()
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        # How many jobs of each tenant run here (the fair share's headroom is for the others).
        self._tenants: Counter[str] = Counter()
        self.generating = 0

    @property
    def in_flight(self) -> int:
        """Jobs taken from the queue and not yet finished (generating, about to, or held for a
        sequence)."""
        return len(self._tasks) + len(self._held)

    @property
    def running(self) -> int:
        """Jobs started (generating or about to), not counting those held for a sequence."""
        return len(self._tasks)

    @property
    def batch_in_flight(self) -> int:
        """Batch lines' jobs among them (not counting those preempted)."""
        return len(self._batch)

    def has_free_sequence(self, reserved: int = 0) -> bool:
        """Whether the worker runs fewer jobs than its engine has sequences, less `reserved` of
        them (at least one stays takeable): a batch line may be taken."""
        return self.in_flight < max(1, self._engine.max_seqs - reserved)

    def has_room_for_interactive(self) -> bool:
        """Whether an interactive job may start: a free sequence, or a batch line's to take."""
        return self.in_flight < self._engine.max_seqs or bool(self._batch)

    @property
    def max_seqs(self) -> int:
        return self._engine.max_seqs

    @property
    def free_sequences(self) -> int:
        """Sequences no interactive job holds (a batch line's may be taken)."""
        return max(0, self._engine.max_seqs - (self.in_flight - len(self._batch)))

    @property
    def tenants_running(self) -> frozenset[str]:
        """The tenants with a job running or held for a sequence here."""
        return frozenset(self._tenants).union(tenant for _, tenant in self._held if tenant is not None)

    @property
    def freed(self) -> asyncio.Event:
        """Set whenever a job ends here (whoever waits on it clears it first)."""
        return self._freed

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        """Start one pushed job in a task of its own (which `drain` tracks). Not in the delivery's
        task: aiormq cancels those when the broker connection drops, and a broker restart must not
        abort the generations in flight. Past the worker's sequences (an interactive job arrived
        while batch lines filled the rest), a batch line's job gives up its sequence.

        With every sequence taken by interactive jobs, the job is held until one frees, unless its
        tenant has none running here and the headroom has room (as a pulled job would start). A
        session manager sends a job straight to a worker that reported a free sequence while
        nothing waited; the worker's puller may fill that sequence from the tenants' queues before
        the job arrives, and the job must not run past the engine's sequences for it."""
        if not self.has_room_for_interactive():
            tenant = _tenant_of(message)
            if not self._in_headroom(tenant):
                self._held.append((message, tenant))
                return
        self.start(message)
        if len(self._tasks) > self._engine.max_seqs:
            self._preempt()

    def _in_headroom(self, tenant: str | None) -> bool:
        """Whether a pushed job of `tenant` may start past the engine's sequences: the headroom
        has room and the tenant has no job running or held here (an unreadable job starts, to be
        dead-lettered)."""
        if len(self._tasks) >= self._engine.max_seqs + self._headroom:
            return False
        return tenant is None or tenant not in self.tenants_running

    def start(self, message: AbstractIncomingMessage) -> None:
        """Start one job in a task of its own (a batch line's, taken into a free sequence)."""
        task = asyncio.create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: "asyncio.Task[None]") -> None:
        self._tasks.discard(task)
        self._batch.pop(task, None)
        self._preempted.discard(task)
        while self._held and len(self._tasks) < self._engine.max_seqs:
            message, _tenant = self._held.popleft()
            if _settleable(message):
                self.start(message)
        self._freed.set()

    def _preempt(self) -> None:
        """Stop the newest batch line's job (the least of its answer to write again) and give it
        back to the batch queue, from where it resumes from its published tokens (`_handle_job`)."""
        if not self._batch:
            return
        task = next(reversed(self._batch))
        del self._batch[task]
        self._preempted.add(task)
        task.cancel()

    async def cancel(self, job_id: str) -> None:
        """A client went away: abort its job if it runs here, skip it if it comes later."""
        self._cancelled[job_id] = None
        while len(self._cancelled) > _CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
        await self._engine.abort(job_id)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for in-flight jobs; hand the rest back to the queue.

        Returns:
            How many jobs were handed back (those held for a sequence among them, given back
            to their queue at once).
        """
        held, self._held = list(self._held), deque()
        for message, _tenant in held:
            with contextlib.suppress(Exception):  # the broker is away: it took the job back with the channel
                await message.nack(requeue=True)
        if not self._tasks:
            return len(held)
        _done, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return len(held) + len(pending)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        clear_contextvars()
        try:
            job = Job.model_validate_json(message.body)
        except ValidationError as exc:
            # Only the fields at fault, never their values (which may hold prompt text).
            fields = sorted({".".join(str(p) for p in e["loc"]) for e in exc.errors()})
            log.error("job_invalid", fields=fields, message_id=message.message_id)
            await self._dead_letter(message, f"invalid job: bad fields {', '.join(fields)}")
            return
        headers = message.headers or {}
        bind_contextvars(
            job_id=job.job_id, tenant=job.tenant, session_id=job.session_id, request_id=headers.get("x-request-id")
        )
        self._tenants[job.tenant] += 1
        self._metrics.tenant_sequences.labels(job.model, job.tenant).set(self._tenants[job.tenant])
        self._observe_wait(job, message)
        try:
            if self._tracing is None:
                await self._handle_job(job, message)
                return
            with self._job_span(self._tracing, job, message):
                await self._handle_job(job, message)
        finally:
            self._tenants[job.tenant] -= 1
            self._metrics.tenant_sequences.labels(job.model, job.tenant).set(self._tenants[job.tenant])
            if self._tenants[job.tenant] <= 0:
                del self._tenants[job.tenant]

    def _observe_wait(self, job: Job, message: AbstractIncomingMessage) -> None:
        """The job's wait from its publish to now, for its tenant: first attempts only (a job handed
        back or redelivered has run before)."""
        published = (message.headers or {}).get(ENQUEUED_AT_HEADER)
        if isinstance(published, int) and not Attempt.first(message).retried:
            band = BATCH if job.batch else INTERACTIVE
            self._metrics.tenant_queue_wait.labels(job.model, job.tenant, band).observe(
                max(0.0, time.time() - published / 1000)
            )

    def _job_span(self, tracing: Tracing, job: Job, message: AbstractIncomingMessage) -> AbstractContextManager[Any]:
        """The job's span on this worker, a child of the session manager's publish (the job
        message's `traceparent`): a redelivered or handed-back job's attempts join the same trace.
        Its time in the queue, from the publish to now, is a `queued` span beside it."""
        headers = message.headers or {}
        parent = context_from(headers)
        published_ns = headers.get(PUBLISHED_AT_HEADER)
        if isinstance(published_ns, int):
            tracing.record("queued", start_ns=published_ns, end_ns=time.time_ns(), context=parent)
        attributes = {
            "axon.job_id": job.job_id,
            "axon.model": job.model,
            "axon.worker_id": self._worker_id,
            "messaging.message.redelivered": bool(message.redelivered),
            "axon.handed_back": HANDED_BACK_HEADER in headers,
        }
        return tracing.span("job", kind=SpanKind.CONSUMER, context=parent, attributes=attributes)

    async def _handle_job(self, job: Job, message: AbstractIncomingMessage) -> None:
        started = time.perf_counter()
        # A batch line's job is preemptable while it is attempted: a cancel then lands in this
        # `try`, whose `CancelledError` branch hands it back.
        task = asyncio.current_task() if job.batch else None
        attempt, outages = Attempt.first(message), 0
        while True:
            try:
                await self._gate.wait_until_up(job=True)
                if task is not None:
                    self._batch[task] = None
                try:
                    ended = await self._attempt(job, message, attempt)
                finally:
                    if task is not None:
                        self._batch.pop(task, None)
                break
            except asyncio.CancelledError:
                # Draining, or a batch line preempted: the job goes back to its queue; its progress
                # lets the next worker resume it.
                await asyncio.shield(self._hand_back(message, job))
                preempted = task in self._preempted
                self._metrics.jobs.labels(job.model, "preempted" if preempted else "handed_back").inc()
                if preempted:
                    log.info("job_preempted", reason="an interactive job needed its sequence")
                raise
            except EngineDied as exc:
                # Left unacked: it goes back to the queue when this worker's broker connection closes
                # as it exits, for another worker to resume (requeued now, it could come back here).
                log.error("job_engine_died", error=str(exc))
                self._metrics.jobs.labels(job.model, "handed_back").inc()
                if self._on_engine_failure is not None:
                    self._on_engine_failure(f"the engine died: {exc}")
                return
            except EngineStopped:
                # Stopped under it (shutdown): no error for its client; the next worker resumes it.
                log.info("job_handed_back", reason="engine stopped")
                await self._hand_back(message, job)
                self._metrics.jobs.labels(job.model, "handed_back").inc()
                return
            except Exception as exc:
                # Redis away: not the job's fault. It waits for Redis, with the worker's other jobs,
                # and goes on from its progress; only one that keeps failing after Redis answers
                # again is treated as a crash.
                if redis_unreachable(exc) and outages < self._max_deliveries:
                    outages += 1
                    await self._gate.outage(exc)
                    attempt = _AFTER_OUTAGE
                    continue
                log.exception("job_crashed", error=repr(exc))
                self._metrics.jobs.labels(job.model, "failed").inc()
                await _ack_or_requeue(message, requeue=True)  # counted on redelivery; dead-lettered past the limit
                return
        if ended is None:
            return  # dead-lettered
        outcome, publisher = ended
        if self._tracing is not None:
            annotate({"axon.outcome": outcome}, error=outcome in _FAILED)
        self._metrics.jobs.labels(job.model, outcome).inc()
        if publisher.resumed:
            self._metrics.jobs.labels(job.model, "resumed").inc()
        await _ack_or_requeue(message)
        log.info(
            "job_finished",
            outcome=outcome,
            chunks=publisher.seq,
            resumed=publisher.resumed,
            duration_ms=round((time.perf_counter() - started) * 1000, 1),
        )

    async def _attempt(
        self, job: Job, message: AbstractIncomingMessage, attempt: Attempt
    ) -> tuple[str, ChunkPublisher] | None:
        """One attempt at `job`: its outcome and publisher, or None if it was dead-lettered."""
        progress, heard = Progress(), True
        if attempt.retried:
            progress, heard = await asyncio.gather(self._failover.load_progress(job.job_id), self._heard(job))
        publisher = ChunkPublisher(
            self._pipe,
            self._names,
            job_id=job.job_id,
            channel=job.channel,
            deadline=job.deadline,
            progress=progress,
            owner=UsageOwner.of(job),
            home=self._home(job),
            chunk_log=ChunkLogTarget.of(job, self._names),
            # The final chunk carries the job span's context back to the session manager.
            traceparent=current_traceparent() if self._tracing is not None else None,
        )
        if progress.done:
            return "duplicate", publisher  # finished before; only its ack was lost
        if not heard:
            # Its requester is gone (a session manager killed, or stopped since it was handed
            # back) and it keeps no chunk log: ended at once, what earlier attempts published charged.
            await publisher.finish_cancelled()
            return "unheard", publisher
        counted = attempt.counted or (attempt.counted_if_started and progress.resume is not None)
        if counted and await self._poisoned(job, publisher, message):
            return None
        return await self._run(job, publisher, progress.resume), publisher

    async def _heard(self, job: Job) -> bool:
        """Whether anyone can still read `job`'s answer: a subscriber on its channel, or its chunk log."""
        if job.chunk_log_ttl_s is not None:
            return True
        _channel, subscribers = await self._pipe.execute("PUBSUB", "NUMSUB", job.channel)
        return int(subscribers) > 0

    def _home(self, job: Job) -> Home | None:
        """The affinity record a session job's answer writes: this worker holds its prefix now."""
        if job.session_id is None or not self._worker_id:
            return None
        return Home(self._names.affinity(job.session_id), self._worker_id)

    async def _poisoned(self, job: Job, publisher: ChunkPublisher, message: AbstractIncomingMessage) -> bool:
        """Count a redelivery; past `max_deliveries`, dead-letter the job and tell its client."""
        reason = await self._failover.count_redelivery(job)
        if reason is None:
            return False
        log.error("job_dead_lettered", reason=reason)
        await publisher.finish_with_error(f"The request could not be completed: it was {reason}.", "server_error")
        await self._dead_letter(message, reason)
        self._metrics.jobs.labels(job.model, "dead_lettered").inc()
        return True

    async def _run(self, job: Job, publisher: ChunkPublisher, resume: Resume | None) -> str:
        if job.job_id in self._cancelled:
            await publisher.finish_cancelled()
            return "cancelled"
        remaining_s = job.deadline - time.time()
        if remaining_s <= 0:
            await publisher.finish_with_error("The request's deadline passed before it started.", "timeout_error")
            return "expired"
        if job.start_by is not None and publisher.seq == 0 and time.time() > job.start_by:
            await publisher.finish_cancelled()  # queued for a cold pool; its requester gave up waiting
            return "cancelled"
        unsupported = sorted(set(job.requires) - self._engine.supports)
        if unsupported:
            await publisher.finish_with_error(
                f"{unsupported[0]} is not supported by the engine serving model {job.model}.", "invalid_request_error"
            )
            return "invalid"
        if job.adapter is not None and job.adapter not in self._engine.adapters:
            # Every worker of a pool serves the same adapters; only a rollout that adds one mixes them.
            await publisher.finish_with_error(
                f"The worker that took this request does not serve the adapter '{job.adapter}' of model "
                f"{job.model}; try again.",
                "server_error",
            )
            return "failed"
        if job.count_only:
            return await self._count(job, publisher)
        try:
            async with asyncio.timeout(remaining_s):
                return await self._generate(job, publisher, resume)
        except TimeoutError:
            await self._engine.abort(job.job_id)
            await publisher.finish_with_error("The request's deadline passed during generation.", "timeout_error")
            return "expired"
        except InvalidPrompt as exc:
            await publisher.finish_with_error(str(exc), "invalid_request_error", param=exc.param, code=exc.code)
            return "invalid"
        except EngineError as exc:
            log.warning("job_failed", error=str(exc))
            await publisher.finish_with_error(str(exc), "server_error")
            return "failed"

    async def _count(self, job: Job, publisher: ChunkPublisher) -> str:
        """Answer a count-only job: its prompt's tokens as the engine reads them, in the usage of
        a final chunk with no text (no sequence is generated, no tokens served)."""
        request = GenerationRequest(
            request_id=job.job_id,
            sampling=job.sampling,
            messages=job.messages,
            prompt=job.prompt,
            tools=job.tools or None,
            adapter=job.adapter,
        )
        try:
            tokens = self._engine.count_prompt_tokens(request)
        except EngineError as exc:
            await publisher.finish_with_error(str(exc), "server_error")
            return "failed"
        await publisher.publish(EngineOutput("", 0, tokens, 0, finish_reason="stop"))
        return "completed"

    async def _generate(self, job: Job, publisher: ChunkPublisher, resume: Resume | None) -> str:
        sampling = job.sampling
        guide = guide_for(job)
        parser = self._engine.tool_call_parser(job)
        publisher.shape(
            parser,
            partial(answer_finish_reason, job) if parser is not None else None,
            echo=(job.prompt or "") if job.echo else "",
        )
        if resume is not None:
            log.info("job_resumed", seq=publisher.seq, completion_tokens=resume.completion_tokens)
            rest = remaining_sampling(sampling, resume)
            if rest is None:
                await publisher.publish(EngineOutput("", 0, publisher.prompt_tokens, 0, finish_reason="length"))
                return "completed"
            sampling = rest
        request = GenerationRequest(
            request_id=job.job_id,
            sampling=sampling,
            messages=job.messages,
            prompt=job.prompt,
            resume=resume,
            tools=job.tools or None,
            guide=guide,
            logprobs=job.logprobs,
            echo=job.echo and resume is None,  # a resumed job's prompt was echoed already
            adapter=job.adapter,
        )
        model = job.model
        started, started_ns = time.perf_counter(), time.time_ns()
        outputs = Coalescer()
        pace_s = BATCH_CHUNK_INTERVAL_S if job.batch else 0.0
        pump = asyncio.create_task(self._pump(outputs, publisher, job=job, started=started, pace_s=pace_s))
        self._metrics.running.labels(model).inc()
        self.generating += 1
        engine_error: EngineError | None = None
        stopped = False
        try:
            try:
                async for out in self._engine.generate(request):
                    if pump.done():
                        # Publishing failed (the error surfaces below): the engine's sequence is
                        # aborted, and its last output ends the loop within a step.
                        if not stopped:
                            stopped = True
                            await self._engine.abort(job.job_id)
                        continue
                    outputs.add(out)
            except EngineError as exc:
                engine_error = exc  # publish what was generated first, then report it
            outputs.close()
            reason, first_token_ns = await pump
        finally:
            self._metrics.running.labels(model).dec()
            self.generating -= 1
            if not pump.done():
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
        if engine_error is not None:
            raise engine_error
        if reason is None:
            raise EngineError("The engine ended the answer without a finish reason.")
        self._metrics.job_duration.labels(model).observe(time.perf_counter() - started, exemplar())
        if self._tracing is not None and first_token_ns is not None:
            self._tracing.record("prefill", start_ns=started_ns, end_ns=first_token_ns)
            generated = {"axon.completion_tokens": publisher.completion_tokens, "axon.chunks": publisher.seq}
            self._tracing.record("generation", start_ns=first_token_ns, end_ns=time.time_ns(), attributes=generated)
        if reason == "cancelled":
            return "unheard" if publisher.unheard else "cancelled"
        return "completed"

    async def _pump(
        self,
        outputs: Coalescer,
        publisher: ChunkPublisher,
        *,
        job: Job,
        started: float,
        pace_s: float = 0.0,
    ) -> tuple[FinishReason | None, int | None]:
        """Publish what the engine produced, merging whatever piled up during the last publish
        (and, with `pace_s`, for that long after it: a batch line's). A chunk nobody received, of
        a job without a chunk log, aborts the engine's sequence: its `cancelled` end comes within
        a step, and its usage is recorded here. The tokens served are counted for the job's tenant
        as they come (`ServiceMeter`): its prompt with the first output, then each output's.

        Returns:
            The answer's finish reason, and when its first output came (Unix time in ns).
        """
        job_id, model, tenant = job.job_id, job.model, job.tenant
        band = BATCH if job.batch else INTERACTIVE
        meter = self._meter
        served = self._metrics.tenant_tokens.labels(model, tenant, band, "output")
        output_tokens = self._metrics.output_tokens.labels(model)
        reason: FinishReason | None = None
        first_ns: int | None = None
        aborted = False
        while (out := await outputs.take()) is not None:
            served.inc(out.n_tokens)
            if meter is not None:
                meter.output(model, band, tenant, out.n_tokens)
            if first_ns is None:
                first_ns = time.time_ns()
                self._metrics.ttft.labels(model).observe(time.perf_counter() - started, exemplar())
                self._metrics.tenant_tokens.labels(model, tenant, band, "prompt").inc(out.prompt_tokens)
                if meter is not None:
                    meter.prompt(model, band, tenant, out.prompt_tokens)
            if out.finish_reason is not None:
                with span(self._tracing, "publish", attributes={"axon.final": True}):
                    await publisher.publish(out)
            else:
                await publisher.publish(out)
            if publisher.unheard and not aborted:
                aborted = True
                log.info("job_unheard", seq=publisher.seq - 1)
                await self._engine.abort(job_id)
            output_tokens.inc(out.n_tokens)
            if out.finish_reason is not None:
                reason = out.finish_reason
                self._metrics.prompt_tokens.labels(model).inc(publisher.prompt_tokens)
                self._metrics.cached_prompt_tokens.labels(model).inc(out.cached_tokens)
            elif pace_s:
                await outputs.gather(pace_s)
        return reason, first_ns


def _tenant_of(message: AbstractIncomingMessage) -> str | None:
    """The tenant of a job message, or None when it is not a job (it fails when handled)."""
    try:
        return Job.model_validate_json(message.body).tenant
    except ValidationError:
        return None


def _settleable(message: AbstractIncomingMessage) -> bool:
    """Whether a delivery's channel is open: one closed with the broker connection was given back
    to its queue by the broker, and starting it would run the job twice."""
    try:
        return not message.channel.is_closed
    except ChannelInvalidStateError:
        return False


async def _ack_or_requeue(message: AbstractIncomingMessage, *, requeue: bool = False) -> None:
    """Ack the job (or, with `requeue`, nack it back to the queue). If the broker connection is gone,
    so is the delivery: the broker redelivers the job, and its progress record says how far it got."""
    try:
        if requeue:
            await message.nack(requeue=True)
        else:
            await message.ack()
    except (AMQPError, ChannelInvalidStateError, ConnectionError) as exc:
        log.warning("job_settle_failed", action="nack" if requeue else "ack", error=repr(exc))


async def listen_for_cancellations(
    url: str, names: Names, runner: JobRunner, gate: RedisGate, *, timeout_s: float
) -> None:
    """Abort jobs whose client went away, as their ids arrive on the cancel channel.

    Survives Redis outages: the subscription is made again as soon as Redis is back (`gate`).
    """
    job_ids: asyncio.Queue[bytes] = asyncio.Queue()
    lost = asyncio.Event()
    subscriber = RedisSubscriber(
        url, timeout_s=timeout_s, on_message=lambda _channel, job_id: job_ids.put_nowait(job_id), on_lost=lost.set
    )
    subscribing = asyncio.create_task(stay_subscribed(subscriber, names.cancel_channel, lost, gate, "cancel_listener"))
    try:
        while True:
            job_id = (await job_ids.get()).decode()
            try:
                await runner.cancel(job_id)
            except Exception as exc:  # noqa: BLE001 - one failed abort must not end the listener
                log.warning("cancel_listener_failed", error=repr(exc))
    finally:
        subscribing.cancel()
        await asyncio.gather(subscribing, return_exceptions=True)
        await subscriber.aclose()


async def stay_subscribed(
    subscriber: RedisSubscriber, channel: str, lost: asyncio.Event, gate: RedisGate, event: str
) -> None:
    """Subscribe to `channel`, and again each time the connection is lost: at once, or, while
    Redis is unreachable, as soon as `gate` finds it back (`event` names it in the log). A message
    published meanwhile is lost."""
    outage = Outage(event)
    while True:
        lost.clear()
        try:
            await subscriber.subscribe(channel)
        except Exception as exc:  # noqa: BLE001 - subscribe again after any failure
            if redis_unreachable(exc):
                gate.report(exc)
                await gate.wait_until_up()
            else:
                await asyncio.sleep(outage.failed(exc))
            continue
        outage.recovered()
        await lost.wait()
        log.info(f"{event}_resubscribing", reason="connection lost")


async def consume(queue: AbstractQueue, runner: JobRunner) -> str:
    """Start delivering jobs to `runner`; returns the consumer tag."""
    return await queue.consume(runner.on_message, no_ack=False)
