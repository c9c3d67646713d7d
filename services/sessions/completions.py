"""A completion request run as jobs, for every endpoint that answers with a model (chat and text
completions, Responses): admitted, its jobs built and published, its first chunk awaited, and
finished once (its answer stored in its session, its unfinished jobs called off, its usage billed).

Order matters:
- subscribe to the jobs' token channels, then publish the jobs, so no chunk can be
  published before someone listens;
- store the answer (Redis + outbox) before the client sees its end, so an answer a
  client received is never missing from its history.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from services.sessions.active_request import ActiveRequest, Choice, chunk_error
from services.sessions.billing import Billing
from services.sessions.catalog import ModelCatalog, require_supported
from services.sessions.chat.protocol import ResponseBuilder
from services.sessions.chunk_log import StreamMeta
from services.sessions.cold_start import cold_start_job, first_after_cold_start
from services.sessions.job_building import JobBuilder, for_choice
from services.sessions.job_publishing import JobPublisher, publish_all
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox
from services.sessions.prefix_routing import PrefixRouter
from services.sessions.relay import MergedStream, TokenRelay, TokenStream
from services.sessions.settings import SessionsSettings
from services.sessions.turns import Turn, Turns
from shared.affinity import job_home
from shared.errors import InvalidRequest, Unavailable
from shared.internal_headers import Caller
from shared.logging import bind_contextvars, get_logger
from shared.names import Names
from shared.openai_requests import ChatCompletionRequest, CompletionRequest, Kind
from shared.ratelimit import RateLimiter
from shared.redis_pipe import RedisPipe
from shared.schemas import Job, TokenChunk, Usage
from shared.tasks import BackgroundTasks
from shared.topology import job_priority
from shared.tracing import SpanKind, Tracing, current_traceparent, exemplar, span

log = get_logger(__name__)


class CompletionService:
    """Admits completion requests, publishes their jobs, and finishes them."""

    def __init__(
        self,
        *,
        settings: SessionsSettings,
        catalog: ModelCatalog,
        relay: TokenRelay,
        publisher: JobPublisher,
        pipe: RedisPipe,
        outbox: Outbox,
        limiter: RateLimiter,
        turns: Turns,
        metrics: SessionsMetrics,
        tracing: Tracing | None = None,
        router: PrefixRouter | None = None,
    ) -> None:
        self._tracing = tracing
        # The prefix index's routing (`prefix_routing.py`); None: session affinity only.
        self._router = router
        self._settings = settings
        self._names = Names(settings.namespace)
        self._catalog = catalog
        self._relay = relay
        self._publisher = publisher
        self._pipe = pipe
        self._turns = turns
        self._metrics = metrics
        self._jobs = JobBuilder(settings)
        self._billing = Billing(
            pipe=pipe,
            names=self._names,
            outbox=outbox,
            limiter=limiter,
            metrics=metrics,
            batch_factor=settings.batch_billing_factor,
        )
        self._background = BackgroundTasks()

    async def start(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        *,
        kind: Kind,
        caller: Caller,
        request_id: str,
        cold_start_wait_s: float | None = None,
        resumable: bool = False,
        timeout_s: float | None = None,
        count_only: bool = False,
    ) -> ActiveRequest:
        """Admit the request and publish its jobs (one per choice, all or none). `resumable`: the
        jobs keep their chunk logs for `AXON_STREAM_LOG_TTL_S` (`services/sessions/chunk_log.py`),
        so their stream can be replayed and followed from any session manager; a streamed session
        turn's job keeps its log unasked, and its chat stream meta (`_keep_stream_meta`).
        `timeout_s`: the jobs' deadline is this far ahead (None: `AXON_REQUEST_TIMEOUT_S`).
        `count_only`: the job counts the prompt's tokens and generates nothing (`Job.count_only`).

        Args:
            cold_start_wait_s: how long the request may wait for a worker of its model to start
                when none is live (its jobs queued meanwhile); None: the model's configured wait
                (`AXON_COLD_START_WAITS`, else `AXON_COLD_START_WAIT_S`). Work that can wait
                longer (a background response) passes more; the request's deadline bounds it.

        Raises:
            ModelNotFound, Unavailable, InvalidRequest, NotFound, Conflict: refused before
            any work was queued.
        """
        started = time.perf_counter()
        tracing = self._tracing
        model, live, wait_s = await self._catalog.require_or_wait(body.model, wait_s=cold_start_wait_s)
        require_supported(body, model, live)
        sampling = self._jobs.sampling(body, live)
        messages, prompt = self._jobs.input(body)
        session_id = body.session_id if isinstance(body, ChatCompletionRequest) else None
        # A session turn's stream can be resumed as a chat stream (`GET /v1/chat/completions/{id}/stream`).
        chat_resumable = session_id is not None and bool(body.stream)
        resumable = resumable or chat_resumable
        n = body.choices
        if n > 1 and session_id is not None:  # refused by the request's check already
            raise InvalidRequest("A session turn has one answer: n must be 1 with session_id.", param="n")
        # Confirmed subscriptions to the new jobs' channels, so no chunk of them can be missed.
        streams = await self._open_streams(n)
        stream: TokenStream | MergedStream = streams[0] if n == 1 else self._relay.merge(streams)
        bind_contextvars(job_id=streams[0].job_id)  # the tenant was bound with the caller
        turn: Turn | None = None
        try:
            if session_id is not None:
                assert messages is not None
                with span(tracing, "history"):
                    turn = await self._turns.begin(
                        tenant=caller.tenant,
                        session_id=session_id,
                        job_id=streams[0].job_id,
                        new_messages=messages,
                        budget_tokens=live.context_tokens - sampling.max_tokens,
                    )
                messages = turn.prompt
            with span(tracing, "build job"):
                job = self._jobs.job(
                    body,
                    *live.route(model),
                    messages=messages,
                    prompt=prompt,
                    sampling=sampling,
                    stream=streams[0],
                    turn=turn,
                    caller=caller,
                )
                if resumable:
                    job.chunk_log_ttl_s = self._settings.stream_log_ttl_s
                if timeout_s is not None:
                    job.deadline = time.time() + timeout_s
                job.count_only = count_only
                if wait_s > 0:
                    job = cold_start_job(job, body, wait_s)
                jobs = [job, *(for_choice(job, i, s) for i, s in enumerate(streams[1:], 1))]
            session_home = turn.home if turn is not None else None
            live = await self._catalog.with_home(model, live, session_home)
            # The worker whose prefix cache holds the conversation, first (`shared/affinity.py`).
            home = job_home(
                session_home=session_home,
                session=turn is not None,
                messages=messages,
                choices=n,
                homes=live.homes,
                prefix_affinity=self._settings.prefix_affinity and self._publisher.affinity,
            )
            router = self._router if n == 1 else None
            if router is not None:
                # The worker whose KV cache holds the longest prefix of the prompt, if the index knows.
                with span(tracing, "prefix index"):
                    route = await router.route(job, live, session_home=session_home)
                if route is not None:
                    home = route.home
                router.count(job.model, route, home=home)
            with span(tracing, "publish", kind=SpanKind.PRODUCER, attributes={"axon.job_id": job.job_id}):
                sent = await publish_all(
                    self._publisher,
                    jobs,
                    priority=job_priority(caller.priority, batch=caller.batch),
                    request_id=request_id,
                    home=home,
                    cancel=self._cancel,
                    headers=tracing.job_headers() if tracing is not None else None,
                )
        except BaseException:
            await stream.close()
            if turn is not None:
                await self._turns.abandon(turn)
            raise
        worker = home if router is not None and sent == "home" else None
        if router is not None and worker is not None:
            router.started(worker)
        if turn is not None:
            try:
                await self._record_question(turn, stream)
            except BaseException:
                if router is not None and worker is not None:
                    router.ended(worker)
                raise
        self._metrics.jobs_published.labels(job.model).inc(n)
        self._metrics.active_streams.inc()
        builder = ResponseBuilder(
            kind=kind,
            job_id=jobs[0].job_id,
            model=body.model,
            include_usage=body.include_usage,
            logprobs=body.logprob_count is not None,
        )
        if chat_resumable:
            self._keep_stream_meta(jobs[0], builder, caller)
        choices = [Choice(i, j) for i, j in enumerate(jobs)]
        active = ActiveRequest(
            choices=choices, caller=caller, stream=stream, builder=builder, started=started, turn=turn
        )
        active.worker = worker
        return active

    def _keep_stream_meta(self, job: Job, builder: ResponseBuilder, caller: Caller) -> None:
        """Record who may resume the job's stream and what its events repeat (`StreamMeta`), as
        long as its chunk log may be kept. Not awaited: it goes out on the pipe before the job's
        first chunk can reach the client, who learns the stream's id from it."""
        meta = StreamMeta(
            tenant=caller.tenant,
            model=builder.model,
            created=builder.created,
            include_usage=builder.include_usage,
            logprobs=builder.logprobs,
            deadline=job.deadline,
            traceparent=current_traceparent() if self._tracing is not None else None,
        )
        ttl_s = max(1, int(job.deadline - time.time())) + self._settings.stream_log_ttl_s
        written = self._pipe.submit("SET", self._names.chunk_log_meta(job.job_id), meta.dumps(), "EX", ttl_s)
        written.add_done_callback(_stream_meta_written)

    async def _open_streams(self, n: int) -> list[TokenStream]:
        """`n` confirmed subscriptions, or none (those opened are closed if one fails).

        Raises:
            Unavailable: Redis did not confirm in time.
        """
        if n == 1:
            return [await self._relay.open_job()]
        opened = await asyncio.gather(*(self._relay.open_job() for _ in range(n)), return_exceptions=True)
        streams = [s for s in opened if isinstance(s, TokenStream)]
        if len(streams) < n:
            for s in streams:
                await s.close()
            raise next(e for e in opened if isinstance(e, BaseException))
        return streams

    async def _record_question(self, turn: Turn, stream: TokenStream | MergedStream) -> None:
        """Store the user's messages of a turn whose job is queued; if they cannot be stored, the
        job is called off (a turn is stored whole or not at all).

        Raises:
            Unavailable: the history could not be written.
        """
        try:
            await self._turns.record_question(turn)
        except _STORAGE_ERRORS as exc:
            log.error("question_not_stored", error=repr(exc))
            await stream.close()
            self._cancel(turn.job_id).add_done_callback(_retrieved)
            await self._turns.abandon(turn)
            raise _history_unavailable() from exc

    def _cancel(self, job_id: str) -> asyncio.Future[Any]:
        """Tell the workers to stop generating (or skip) job `job_id`: submitted, not awaited."""
        return self._pipe.submit("PUBLISH", self._names.cancel_channel, job_id)

    async def first_chunk(
        self, active: ActiveRequest, *, on_wait: Callable[[], Awaitable[None]] | None = None
    ) -> tuple[tuple[Choice, TokenChunk], AsyncIterator[tuple[Choice, TokenChunk]]]:
        """Wait for the first chunk (of any choice), so failures before any token get a real status code.

        Args:
            on_wait: called every `KEEPALIVE_INTERVAL_S` while a request queued for a model with
                no live worker waits for one to start (a streaming one sends a keep-alive comment).

        Raises:
            Unavailable: `no_worker`, the request's cold-start wait passed first.
        """
        chunks = active.chunks()
        async with self.finished_if_failed(active):
            # Inline for the hot path; a request queued for a cold pool waits in `first_of`.
            first = await (
                anext(chunks) if active.job.start_by is None else self.first_of(active, chunks, on_wait=on_wait)
            )
            if first[1].finish_reason == "error":
                raise chunk_error(first[1])
        self._metrics.ttft.labels(active.job.model).observe(time.perf_counter() - active.started, exemplar())
        return first, chunks

    async def gather(
        self, active: ActiveRequest, first: tuple[Choice, TokenChunk], rest: AsyncIterator[tuple[Choice, TokenChunk]]
    ) -> tuple[Choice, TokenChunk]:
        """Read the chunks after `first` to the final one (each choice's answer is built as they
        come, its logprobs too), then finish the request; returns the final chunk and its choice.

        Raises:
            UpstreamError, DeadlineExceeded: the answer failed (finished as `error`).
        """
        choice, chunk = first
        async with self.finished_if_failed(active):
            while True:
                if chunk.logprobs is not None:
                    choice.answer.logprobs.extend(chunk.logprobs)
                if chunk.finish_reason == "error":
                    raise chunk_error(chunk)
                if not active.unfinished:
                    break
                choice, chunk = await anext(rest)
        await self.finish(active, outcome=chunk.finish_reason or "stop")
        return choice, chunk

    @contextlib.asynccontextmanager
    async def finished_if_failed(self, active: ActiveRequest) -> AsyncIterator[None]:
        """Finish `active` if the block fails: as `disconnected` if it is cancelled (its client
        left; the finish is shielded from that cancellation), else as `error`."""
        try:
            yield
        except asyncio.CancelledError:
            await asyncio.shield(self.finish(active, outcome="disconnected"))
            raise
        except BaseException:
            await self.finish(active, outcome="error")
            raise

    async def first_of(
        self,
        active: ActiveRequest,
        chunks: AsyncIterator[tuple[Choice, TokenChunk]],
        *,
        on_wait: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[Choice, TokenChunk]:
        """The first of `active`'s `chunks`; for a request queued while its model had no live worker,
        waited for only until its job's `start_by` (`first_after_cold_start`).

        Raises:
            Unavailable: `no_worker`, the request's cold-start wait passed first.
            DeadlineExceeded, UpstreamError: as `ActiveRequest.chunks`.
        """
        if active.job.start_by is None:
            return await anext(chunks)
        return await first_after_cold_start(active, chunks, on_wait=on_wait, metrics=self._metrics)

    async def finish(self, active: ActiveRequest, *, outcome: str) -> None:
        """Stop relaying (once): store the answer, tell the workers to stop generating every choice
        whose answer is not complete, record and charge the usage, and release the session and the
        caller's lease.

        The usage of a choice whose final chunk has not come (a client that left, a failure of
        another choice, a deadline) is settled in the background (`Billing.settle_later`), once the worker's final
        chunk tells what it generated.

        Raises:
            Unavailable: a complete answer of a session turn could not be stored (Redis away):
                its client must not take it for saved.
        """
        if active.closed:
            return
        active.closed = True
        self._ended(active)
        self._metrics.active_streams.dec()
        self._metrics.outcomes.labels(active.job.model, outcome).inc()
        unfinished = [c for c in active.choices if c.answer.finish_reason is None]
        if not unfinished:
            await active.stream.close()
        # Submitted now, they go out before the history is written.
        cancels = [self._cancel(c.job.job_id) for c in unfinished]
        not_stored: Exception | None = None
        try:
            if active.turn is not None:
                status = _ANSWER_STATUSES.get(outcome, "failed")
                answer = active.choices[0].answer
                try:
                    with span(self._tracing, "history write"):
                        await self._turns.record_answer(
                            active.turn, text=answer.content, status=status, tool_calls=answer.tool_calls
                        )
                except _STORAGE_ERRORS as exc:
                    log.error("answer_not_stored", error=repr(exc))
                    not_stored = exc
        finally:
            # Also when this task is cancelled while the answer is stored (the client left then):
            # `closed` is set, so nothing else would charge the request or release its lease.
            if unfinished:
                self._billing.settle_later(active, unfinished, cancels)
            else:
                await self._billing.charge(active, cancels)
        if not_stored is not None and _ANSWER_STATUSES.get(outcome) == "complete":
            raise _history_unavailable() from not_stored

    async def hand_over(self, active: ActiveRequest) -> None:
        """Stop relaying `active` without finishing it: a stored response's relay that gave the
        response up (its stream was lost, its lease taken, its process stopping). Its job runs on,
        and whoever stores the response settles the request from its record (`Billing.settle`)."""
        if active.closed:
            return
        active.closed = True
        self._ended(active)
        self._metrics.active_streams.dec()
        await active.stream.close()

    def _ended(self, active: ActiveRequest) -> None:
        """The request no longer counts towards its worker's load (`PrefixRouter`)."""
        if self._router is not None and active.worker is not None:
            self._router.ended(active.worker)

    async def settle(self, caller: Caller, usage: Usage | None) -> None:
        """Settle the admission of a request whose relay handed it over (`hand_over`) to its real
        token use `usage` (`Billing.settle`)."""
        await self._billing.settle(caller, usage)

    async def interrupt_streams(self) -> None:
        """The stop's deadline passed (shared/serving.py): every answer still relayed ends as a lost
        stream, so its client gets a `stream_interrupted` error event and `[DONE]` (and its workers a
        cancel notice) rather than a cut connection."""
        await self._relay.stop()

    def finish_later(self, active: ActiveRequest, *, outcome: str) -> None:
        """`finish` in a task of its own: the caller's task may itself be cancelled (its client
        gone), and the cancel notices must still go out."""
        self._background.spawn(self.finish(active, outcome=outcome))


# How a session turn's answer is stored, by the request's outcome (anything else: `failed`).
_ANSWER_STATUSES = {
    "stop": "complete",
    "length": "complete",
    "tool_calls": "complete",
    "cancelled": "cancelled",
    "disconnected": "cancelled",
}
# A store that cannot be reached (a history write that failed).
_STORAGE_ERRORS = (RedisError, ConnectionError, TimeoutError)


def _history_unavailable() -> Unavailable:
    return Unavailable(
        "The session's history could not be saved, so this answer was not kept; try again shortly.",
        retry_after_s=2,
        code="history_unavailable",
    )


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A best-effort write's outcome: an error is only logged."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("cancel_publish_failed", error=repr(future.exception()))


def _stream_meta_written(future: asyncio.Future[Any]) -> None:
    """A stream meta's write's outcome: a failure only makes the stream not resumable."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("stream_meta_failed", error=repr(future.exception()))
