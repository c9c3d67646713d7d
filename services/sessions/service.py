"""Turns a completion request into jobs (one per choice, `n`) and relays their chunks back.

Order matters:
- subscribe to the jobs' token channels, then publish the jobs, so no chunk can be
  published before someone listens;
- store the answer (Redis + outbox) before the client sees its end, so an answer a
  client received is never missing from its history.
"""

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError
from redis.exceptions import RedisError

from services.sessions.catalog import NO_WORKER_RETRY_AFTER_S, ModelCatalog, require_supported
from services.sessions.chunk_log import ChunkLog, LoggedStream, StreamMeta
from services.sessions.jobs import JobPublisher, conversation_home
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox, UsageRow
from services.sessions.relay import STREAM_LOST, MergedStream, TokenRelay, TokenStream
from services.sessions.responses import (
    USAGE_EVENT_ID,
    Answer,
    ResponseBuilder,
    request_usage,
    sse_event,
    sse_named_event,
    work_usage,
)
from services.sessions.settings import SessionsSettings
from services.sessions.turns import Turn, Turns
from shared.errors import AxonError, DeadlineExceeded, InvalidRequest, Unavailable, UpstreamError
from shared.logging import bind_contextvars, get_logger
from shared.names import Names
from shared.openai_requests import ChatCompletionRequest, CompletionRequest, Kind
from shared.ratelimit import BudgetReservation, RateLimiter
from shared.redis_pipe import PipeScript, RedisPipe
from shared.registry import LiveModel
from shared.responses import SSE_END
from shared.schemas import Job, Message, Sampling, TokenChunk, Usage
from shared.tasks import BackgroundTasks

log = get_logger(__name__)

_ERROR_TYPES: dict[str, type[AxonError]] = {
    "timeout_error": DeadlineExceeded,
    "invalid_request_error": InvalidRequest,
}
HISTORY_DROPPED_HEADER = "x-axon-history-dropped"
# How often a request waiting for a worker of its model to start is told (`on_wait`: a streaming
# one sends an SSE comment), so no proxy on the way closes its idle connection.
KEEPALIVE_INTERVAL_S = 5.0


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking, as the gateway vouches for it, and what its admission was charged."""

    tenant: str
    priority: int = 0
    key_id: str | None = None
    tpm_limit: int = 0
    prompt_estimate: int = 0
    # The gateway's concurrency lease for this request, released when the answer ends.
    lease_id: str | None = None
    # What the gateway reserved of the key's token budget, settled to the usage when the answer ends.
    budget: BudgetReservation | None = None


def chunk_error(chunk: TokenChunk) -> AxonError:
    """The exception a worker's error chunk stands for."""
    if chunk.error is None:
        return UpstreamError("The worker failed to generate an answer.")
    error = chunk.error
    return _ERROR_TYPES.get(error.type, UpstreamError)(error.message, param=error.param, code=error.code)


class Choice:
    """One choice of a request: its job, the next `seq` expected on it, and its answer so far."""

    __slots__ = ("answer", "index", "job", "next_seq", "sent", "tokens")

    def __init__(self, index: int, job: Job) -> None:
        self.index = index
        self.job = job
        self.next_seq = 0
        # Completion tokens of the chunks received (what is charged if the final chunk never comes).
        self.tokens = 0
        # Its first chunk was relayed (the next one carries no role).
        self.sent = False
        self.answer = Answer(index)


class ActiveRequest:
    """A request whose jobs (one per choice) are published and whose chunks are being received,
    deduplicated by `seq` per choice, until its deadline."""

    def __init__(
        self,
        *,
        choices: list[Choice],
        caller: Caller,
        stream: TokenStream | MergedStream | LoggedStream,
        builder: ResponseBuilder,
        started: float,
        turn: Turn | None,
    ) -> None:
        self.choices = choices
        # The first choice's job: the request's model, deadline, and the id its usage is recorded under.
        self.job = choices[0].job
        self.caller = caller
        self.stream = stream
        self.builder = builder
        self.started = started
        self.turn = turn
        # Choices whose final chunk has not arrived.
        self.unfinished = len(choices)
        self.closed = False
        self.usage: Usage | None = None
        # The stream ended before its chunks did (STREAM_LOST): nothing more arrives on it.
        self.lost = False

    def headers(self) -> dict[str, str]:
        return {HISTORY_DROPPED_HEADER: str(self.turn.dropped)} if self.turn else {}

    async def chunks(self) -> AsyncIterator[tuple[Choice, TokenChunk]]:
        """Yield each choice's chunks in order (choices interleaved as they arrive) until every
        choice's final one.

        Raises:
            DeadlineExceeded: the job's deadline passed first.
            UpstreamError: the stream was lost (shutdown or a client too slow to keep up).
        """
        stream, choices, deadline = self.stream, self.choices, self.job.deadline
        while self.unfinished:
            remaining_s = deadline - time.time()
            try:
                if remaining_s <= 0:
                    raise TimeoutError
                raw = await stream.next(remaining_s)
            except TimeoutError:
                raise DeadlineExceeded("The request's deadline passed before the answer was complete.") from None
            if raw == STREAM_LOST:
                self.lost = True
                raise UpstreamError("The answer's stream was interrupted.", code="stream_interrupted")
            try:
                chunk = TokenChunk.model_validate_json(raw)
            except ValidationError:
                log.error("chunk_invalid", size_bytes=len(raw))
                continue
            choice = choices[stream.index]
            if chunk.seq < choice.next_seq:
                continue  # already relayed: a redelivered job repeats its chunks
            if chunk.seq > choice.next_seq:
                log.warning("chunk_gap", expected=choice.next_seq, got=chunk.seq, choice=choice.index)
            choice.next_seq = chunk.seq + 1
            choice.tokens += chunk.n_tokens
            answer = choice.answer
            answer.text.append(chunk.text)
            if chunk.tool_calls is not None:
                answer.add_tool_calls(chunk.tool_calls)
            if chunk.usage is not None:
                answer.usage = chunk.usage
            if chunk.finish_reason is not None and answer.finish_reason is None:
                answer.finish_reason = chunk.finish_reason
                self.unfinished -= 1
            yield choice, chunk


class CompletionService:
    """Admits completion requests, publishes their jobs, and relays the answers."""

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
        chunk_log: ChunkLog | None = None,
    ) -> None:
        self._settings = settings
        self._names = Names(settings.namespace)
        self._catalog = catalog
        self._relay = relay
        self._publisher = publisher
        self._pipe = pipe
        self._outbox = outbox
        self._limiter = limiter
        self._turns = turns
        self._metrics = metrics
        # Where a session turn whose relayed stream was lost reads on (`_relay_detached`).
        self._chunk_log = chunk_log
        # Set once the stop's deadline ends every stream (`interrupt_streams`): none goes on.
        self._stopping = False
        self._background = BackgroundTasks()
        # Session turns relayed on after their clients left (`_relay_detached`).
        self._detached = BackgroundTasks()

    def _sampling(self, body: ChatCompletionRequest | CompletionRequest, live: LiveModel) -> Sampling:
        max_tokens = body.requested_max_tokens or min(self._settings.default_max_tokens, live.context_tokens // 2)
        limit = min(self._settings.max_tokens_limit, live.context_tokens)
        if max_tokens > limit:
            raise InvalidRequest(
                f"max_tokens is {max_tokens}, more than this model allows ({limit}).", param="max_tokens"
            )
        return body.sampling(max_tokens)

    def _check_messages(self, messages: list[Message]) -> None:
        if len(messages) > self._settings.max_messages:
            raise InvalidRequest(
                f"{len(messages)} messages is more than the {self._settings.max_messages} allowed.", param="messages"
            )

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
    ) -> ActiveRequest:
        """Admit the request and publish its jobs (one per choice, all or none). `resumable`: the
        jobs keep their chunk logs for `AXON_STREAM_LOG_TTL_S` (`services/sessions/chunk_log.py`),
        so their stream can be replayed and followed from any session manager; a streamed session
        turn's job keeps its log unasked, and its chat stream meta (`_keep_stream_meta`).
        `timeout_s`: the jobs' deadline is this far ahead (None: `AXON_REQUEST_TIMEOUT_S`).

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
        model, live, wait_s = await self._catalog.require_or_wait(body.model, wait_s=cold_start_wait_s)
        require_supported(body, model, live)
        sampling = self._sampling(body, live)
        messages, prompt = self._input(body)
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
                turn = await self._turns.begin(
                    tenant=caller.tenant,
                    session_id=session_id,
                    job_id=streams[0].job_id,
                    new_messages=messages,
                    budget_tokens=live.context_tokens - sampling.max_tokens,
                )
                messages = turn.prompt
            job = self._job(
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
            if wait_s > 0:
                job = _cold_start(job, body, wait_s)
            jobs = [job, *(_for_choice(job, i, s) for i, s in enumerate(streams[1:], 1))]
            # A session's job goes to the worker that served its last turn while it is live and
            # not draining (its prefix cache holds the conversation), a sessionless conversation's
            # to the worker its first exchange hashes to; RabbitMQ spills it over.
            home: str | None = None
            if turn is not None:
                home = turn.home if turn.home in live.homes else None
            elif n == 1 and messages is not None and self._settings.prefix_affinity and self._publisher.affinity:
                home = conversation_home(messages, live.homes)
            await self._publish(jobs, priority=caller.priority, request_id=request_id, home=home)
        except BaseException:
            await stream.close()
            if turn is not None:
                await self._turns.abandon(turn)
            raise
        if turn is not None:
            await self._record_question(turn, stream)
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
        return ActiveRequest(choices=choices, caller=caller, stream=stream, builder=builder, started=started, turn=turn)

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

    def _input(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[list[Message] | None, str | None]:
        """The request's messages (a chat, checked) or its prompt (a completion)."""
        if isinstance(body, ChatCompletionRequest):
            messages = [m.to_message() for m in body.messages]
            self._check_messages(messages)
            return messages, None
        return None, body.prompt_text

    def _job(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        model: str,
        adapter: str | None,
        *,
        messages: list[Message] | None,
        prompt: str | None,
        sampling: Sampling,
        stream: TokenStream,
        turn: Turn | None,
        caller: Caller,
    ) -> Job:
        """The job of the request's first choice for `model`'s queue (naming `adapter`, a LoRA
        adapter of it, if set), answered on `stream`'s channel."""
        features: dict[str, Any] = {}
        if isinstance(body, ChatCompletionRequest):
            if body.tools is not None:  # tool_choice `none`: no tools
                features.update(
                    tools=body.tool_specs(), tool_choice=body.job_tool_choice(), parallel_tool_calls=body.parallel_calls
                )
            if body.response_format is not None:
                features["response_format"] = body.job_response_format()
        elif body.echo:
            features["echo"] = True
        return Job(
            job_id=stream.job_id,
            model=model,
            adapter=adapter,
            messages=messages,
            prompt=prompt,
            sampling=sampling,
            channel=stream.channel,
            deadline=time.time() + self._settings.request_timeout_s,
            session_id=turn.info.id if turn else None,
            tenant=caller.tenant,
            key_id=caller.key_id,
            logprobs=body.logprob_count,
            **features,
        )

    async def _publish(self, jobs: list[Job], *, priority: int, request_id: str, home: str | None = None) -> None:
        """Publish every job, or none: when one fails, the others are called off. `home`: the
        worker whose own queue a session's (single) job goes to first.

        Raises:
            Unavailable: a job could not be queued.
        """
        publishes = [self._publisher.publish(job, priority=priority, request_id=request_id, home=home) for job in jobs]
        results: list[BaseException | None]
        if len(publishes) == 1:
            try:
                await publishes[0]
                return
            except Unavailable as exc:
                results = [exc]
        else:
            results = await asyncio.gather(*publishes, return_exceptions=True)
        failure = next((r for r in results if r is not None), None)
        if failure is None:
            return
        for job, result in zip(jobs, results, strict=True):
            # Unconfirmed (the broker went away before its confirm) or published, a job may be
            # queued: workers skip a job they were told was cancelled, so none answers it for nobody.
            if not (isinstance(result, Unavailable) and result.code == "queue_full"):
                self._cancel(job.job_id).add_done_callback(_retrieved)
        raise failure

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

    async def interrupt_streams(self) -> None:
        """The stop's deadline passed (shared/serving.py): every answer still relayed ends as a lost
        stream, so its client gets a `stream_interrupted` error event and `[DONE]` (and its workers a
        cancel notice) rather than a cut connection. Session turns relayed on after their clients
        left are called off (`_relay_detached`), whether they read pub/sub or their chunk logs."""
        self._stopping = True
        self._detached.cancel()
        await self._relay.stop()

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
        try:
            # Inline for the hot path; a request queued for a cold pool waits in `first_of`.
            first = await (
                anext(chunks) if active.job.start_by is None else self.first_of(active, chunks, on_wait=on_wait)
            )
            if first[1].finish_reason == "error":
                raise chunk_error(first[1])
        except asyncio.CancelledError:
            await asyncio.shield(self.finish(active, outcome="disconnected"))
            raise
        except BaseException:
            await self.finish(active, outcome="error")
            raise
        self._metrics.ttft.labels(active.job.model).observe(time.perf_counter() - active.started)
        return first, chunks

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

    async def collect(
        self, active: ActiveRequest, first: tuple[Choice, TokenChunk], rest: AsyncIterator[tuple[Choice, TokenChunk]]
    ) -> dict[str, Any]:
        """Gather the whole answer into one OpenAI response object (stored before it is returned)."""
        choice, chunk = first
        try:
            while True:
                if chunk.logprobs is not None:
                    choice.answer.logprobs.extend(chunk.logprobs)
                if chunk.finish_reason == "error":
                    raise chunk_error(chunk)
                if not active.unfinished:
                    break
                choice, chunk = await anext(rest)
        except asyncio.CancelledError:
            await asyncio.shield(self.finish(active, outcome="disconnected"))
            raise
        except BaseException:
            await self.finish(active, outcome="error")
            raise
        await self.finish(active, outcome=chunk.finish_reason or "stop")
        return active.builder.response([c.answer for c in active.choices], active.usage)

    async def sse(
        self, active: ActiveRequest, first: tuple[Choice, TokenChunk], rest: AsyncIterator[tuple[Choice, TokenChunk]]
    ) -> AsyncIterator[bytes]:
        """Relay chunks as OpenAI server-sent events (each with its choice's index), ending with
        `data: [DONE]`.

        Events of chunks that arrived together go out as one piece (one socket write), and the
        last chunk's event, the usage event and `[DONE]` as one. Each event has its `id:`
        (`responses.py`). A resumable session turn whose client leaves goes on to its end
        (`_relay_detached`); any other request is called off.
        """
        builder = active.builder
        several = len(active.choices) > 1
        inter_token = self._metrics.inter_token.labels(active.job.model)
        outcome = "disconnected"
        last_at = time.perf_counter()
        events: list[bytes] = []
        try:
            choice, chunk = first
            while True:
                if chunk.finish_reason is not None:
                    if chunk.finish_reason == "error":
                        raise chunk_error(chunk)
                    if not active.unfinished:
                        outcome = chunk.finish_reason
                        await self.finish(active, outcome=outcome)  # stored before the client sees the end
                # `has_event`, inlined: every chunk of every stream passes here.
                if chunk.text or chunk.finish_reason is not None or not choice.sent or chunk.tool_calls:
                    payload = builder.chunk(choice.index, chunk, first=not choice.sent)
                    if several:
                        events.append(sse_named_event(b"%d.%d" % (chunk.seq, choice.index), payload))
                    else:
                        events.append(sse_event(chunk.seq, payload))
                    choice.sent = True
                if not active.unfinished:
                    break
                if events and not active.stream.ready:
                    yield b"".join(events)
                    events.clear()
                choice, chunk = await anext(rest)
                now = time.perf_counter()
                inter_token.observe(now - last_at)
                last_at = now
            if builder.include_usage and active.usage is not None:
                usage = builder.usage_chunk(active.usage)
                if several:
                    events.append(sse_named_event(USAGE_EVENT_ID, usage))
                else:
                    events.append(sse_event(active.choices[0].next_seq, usage))
            events.append(SSE_END)
            yield b"".join(events)
        except AxonError as exc:
            outcome = "error"
            log.warning("stream_failed", error=exc.message)
            if active.lost and self._reads_on_from_log(active):
                outcome = "disconnected"  # its client resumes; the turn goes on from its chunk log
            else:
                await self.finish(active, outcome=outcome)
            yield b"".join([*events, sse_error(exc)])
        finally:
            if outcome == "disconnected":
                # In its own task: this one may itself be cancelled (client gone), and the
                # cancel notice must still go out.
                if active.turn is not None and active.job.chunk_log_ttl_s is not None:
                    self._detached.spawn(self._relay_detached(active))
                else:
                    self._background.spawn(self.finish(active, outcome=outcome))

    def _reads_on_from_log(self, active: ActiveRequest) -> bool:
        """Whether a session turn whose relayed stream was lost (Redis dropped the relay's
        connection, a slow client's buffer overflowed) reads the rest from its job's chunk log,
        rather than being called off: it keeps one, and the process is not stopping."""
        return (
            active.turn is not None
            and active.job.chunk_log_ttl_s is not None
            and self._chunk_log is not None
            and not self._stopping
        )

    async def _relay_detached(self, active: ActiveRequest) -> None:
        """Relay a resumable session turn whose client left (or whose stream was lost) to its end,
        and finish it as if the client had stayed: its whole answer is stored in the session's
        history and its usage charged, and the client can come back for the rest of its stream (its
        chunk log). A lost stream's rest is read from the log. Its deadline bounds the wait."""
        if active.closed:
            return
        log.info("stream_detached", lost=active.lost)
        outcome = "disconnected"
        try:
            if active.lost:
                await self._read_on_from_log(active)
            try:
                outcome = await _relayed_to_end(active, called_off=self._called_off)
            except UpstreamError:
                if not active.lost:  # lost now: the rest is in the log
                    raise
                await self._read_on_from_log(active)
                outcome = await _relayed_to_end(active, called_off=self._called_off)
        except (AxonError, RedisError) as exc:
            log.warning("stream_failed", error=repr(exc))
            outcome = "error"
        except asyncio.CancelledError:
            await asyncio.shield(self.finish(active, outcome="disconnected"))
            raise
        with contextlib.suppress(Unavailable):  # not stored: `finish` logged it
            await self.finish(active, outcome=outcome)

    def _called_off(self) -> bool:
        """The stop's deadline passed: turns relayed on after their clients left end now, as
        cancelled (their task's cancellation alone did not always reach a turn following its log)."""
        return self._stopping

    async def _read_on_from_log(self, active: ActiveRequest) -> None:
        """Make a session turn whose relayed stream was lost read its chunks from its job's log,
        from the first it has not received (`ActiveRequest.chunks` goes on as before).

        Raises:
            UpstreamError: it cannot (`_reads_on_from_log`: the process is stopping).
        """
        if not self._reads_on_from_log(active) or self._chunk_log is None:
            raise UpstreamError("The answer's stream was interrupted.", code="stream_interrupted")
        choice = active.choices[0]
        await active.stream.close()
        # `ActiveRequest.chunks` gives up at the deadline itself.
        idle_timeout_s = max(1.0, active.job.deadline - time.time())
        follow = self._chunk_log.follow(choice.job.job_id, choice.next_seq - 1, idle_timeout_s=idle_timeout_s)
        active.stream, active.lost = LoggedStream(follow), False

    async def detached_ended(self) -> None:
        """Until every session turn relayed on after its client left has ended: a stopping session
        manager finishes them before it closes its connections. Each ends by its deadline, or at the
        stop's deadline (`interrupt_streams`: as an interrupted stream)."""
        await self._detached.wait()

    async def finish(self, active: ActiveRequest, *, outcome: str) -> None:
        """Stop relaying (once): store the answer, tell the workers to stop generating every choice
        whose answer is not complete, record and charge the usage, and release the session and the
        caller's lease.

        The usage of a choice whose final chunk has not come (a client that left, a failure of
        another choice, a deadline) is settled in the background (`_settle`), once the worker's final
        chunk tells what it generated.

        Raises:
            Unavailable: a complete answer of a session turn could not be stored (Redis away):
                its client must not take it for saved.
        """
        if active.closed:
            return
        active.closed = True
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
                self._background.spawn(self._settle(active, unfinished, cancels))
            else:
                await self._charge(active, cancels)
        if not_stored is not None and _ANSWER_STATUSES.get(outcome) == "complete":
            raise _history_unavailable() from not_stored

    async def _charge(self, active: ActiveRequest, cancels: list[asyncio.Future[Any]]) -> None:
        """Record and charge the usage every choice's answer carries."""
        usages = [c.answer.usage for c in active.choices]
        active.usage = request_usage(usages)
        work = work_usage(usages)
        if work is not None:
            self._metrics.output_tokens.labels(active.job.model).inc(work.completion_tokens)
        await self._bill_and_release(active, cancels, work)

    async def _settle(
        self, active: ActiveRequest, unfinished: list[Choice], cancels: list[asyncio.Future[Any]]
    ) -> None:
        """Charge a request that ended before the final chunks of `unfinished` choices came.

        Their workers were told to stop, and a stopped (or failed) job's final chunk carries every
        token it generated, over all its attempts: it is awaited for up to `USAGE_SETTLE_WAIT_S`.
        A choice whose final chunk does not come (its worker died, or the job is still queued) is
        charged what its worker recorded as published (`<ns>:progress:<job>`), or at least what
        was received.
        """
        try:
            missing = await self._await_finals(active, unfinished)
        finally:
            await active.stream.close()
        if missing:
            await self._recorded_usage(missing)
        for choice in unfinished:
            if choice.answer.usage is None:
                choice.answer.usage = Usage(completion_tokens=choice.tokens)
        await self._charge(active, cancels)

    async def _await_finals(self, active: ActiveRequest, unfinished: list[Choice]) -> list[Choice]:
        """Read `active`'s stream until every choice of `unfinished` has its final chunk, for up to
        `USAGE_SETTLE_WAIT_S` (not at all once the stream is lost); returns those whose final chunk
        did not come."""
        stream, choices = active.stream, active.choices
        waiting = {c.index for c in unfinished}
        until = time.monotonic() + USAGE_SETTLE_WAIT_S
        while waiting and not active.lost:
            try:
                raw = await stream.next(until - time.monotonic())
            except TimeoutError:
                break
            if raw == STREAM_LOST:
                active.lost = True
                break
            try:
                chunk = TokenChunk.model_validate_json(raw)
            except ValidationError:
                continue
            choice = choices[stream.index]
            if chunk.seq < choice.next_seq:
                continue
            choice.next_seq = chunk.seq + 1
            choice.tokens += chunk.n_tokens
            if chunk.finish_reason is not None and choice.index in waiting:
                waiting.discard(choice.index)
                choice.answer.usage = chunk.usage
        return [c for c in unfinished if c.index in waiting]

    async def _recorded_usage(self, choices: list[Choice]) -> None:
        """Set each choice's usage from its job's progress in Redis: the tokens its attempts
        published (at least those received), and the prompt's. The progress is marked `billed`
        at the same time, so a final chunk its worker publishes later does not record the job's
        usage again (`services/worker/publisher.py`)."""
        now = time.time()
        reads = [
            self._pipe.submit_script(
                _MARK_BILLED,
                [self._names.job_progress(c.job.job_id)],
                [max(1, int(c.job.deadline - now) + _BILLED_MARK_GRACE_S)],
            )
            for c in choices
        ]
        results = await asyncio.gather(*reads, return_exceptions=True)
        for choice, result in zip(choices, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("usage_progress_read_failed", error=repr(result))
                continue
            completion, prompt = result
            choice.answer.usage = Usage(
                prompt_tokens=int(prompt or 0), completion_tokens=max(int(completion or 0), choice.tokens)
            )

    async def _bill_and_release(
        self, active: ActiveRequest, cancels: list[asyncio.Future[Any]], usage: Usage | None
    ) -> None:
        """The request's bookkeeping, in one Redis write: its usage row, the charge of its real
        token use `usage` (every choice's job; correcting the gateway's estimate, once for the
        whole request), the settlement of its token budget reservation to that use and the
        release of the caller's concurrency lease; then the outcome of those and of the cancel
        notices. None of it may fail the answer."""
        writes: list[tuple[str, asyncio.Future[Any]]] = [("cancel_publish", cancel) for cancel in cancels]
        job, caller = active.job, active.caller
        if usage is not None:
            row = UsageRow(
                job_id=job.job_id,
                tenant=caller.tenant,
                key_id=caller.key_id,
                model=job.adapter or job.model,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                latency_ms=int((time.perf_counter() - active.started) * 1000),
                created_at=dt.datetime.now(dt.UTC),
            )
            writes.append(("usage_record", self._pipe.submit(*self._outbox.append_command("usage", row))))
        writes += self._settlement(caller, usage)
        await _written(writes)

    def _settlement(self, caller: Caller, usage: Usage | None) -> list[tuple[str, asyncio.Future[Any]]]:
        """The writes that settle `caller`'s admission to its real token use `usage` (None: not
        known): the charge of the difference from the gateway's estimate, the settlement of its
        token budget reservation, the release of its concurrency lease."""
        writes: list[tuple[str, asyncio.Future[Any]]] = []
        if caller.key_id is None:
            return writes
        if usage is not None:
            cost = usage.completion_tokens + usage.prompt_tokens - caller.prompt_estimate
            if caller.tpm_limit and cost:
                writes.append(("token_charge", self._limiter.submit_charge(caller.key_id, caller.tpm_limit, cost)))
        if caller.budget is not None:
            spent = usage.prompt_tokens + usage.completion_tokens if usage is not None else 0
            writes.append(("budget_settle", self._limiter.submit_budget_settle(caller.key_id, caller.budget, spent)))
        if caller.lease_id is not None:
            writes.append(("lease_release", self._limiter.submit_release(caller.key_id, caller.lease_id)))
        return writes

    async def hand_over(self, active: ActiveRequest) -> None:
        """Stop relaying `active` without finishing it: a stored response's relay that gave the
        response up (its stream was lost, its lease taken, its process stopping). Its job runs on,
        and whoever stores the response settles the request from its record (`settle`)."""
        if active.closed:
            return
        active.closed = True
        self._metrics.active_streams.dec()
        await active.stream.close()

    async def settle(self, caller: Caller, usage: Usage | None) -> None:
        """Settle the admission of a request whose relay handed it over (`hand_over`) to its real
        token use `usage`, as `finish` does. Its usage row is its worker's: nobody received its
        final chunk. None of it may fail the caller."""
        await _written(self._settlement(caller, usage))


async def _written(writes: list[tuple[str, asyncio.Future[Any]]]) -> None:
    """Await `writes` (what, future), logging those that failed."""
    results = await asyncio.gather(*(future for _, future in writes), return_exceptions=True)
    for (what, _), result in zip(writes, results, strict=True):
        if isinstance(result, Exception):
            log.warning(f"{what}_failed", error=repr(result))


# How long a request that ended before its jobs did waits for their final chunks, which carry the
# tokens they generated, before charging what their progress records (`CompletionService._settle`).
USAGE_SETTLE_WAIT_S = 5.0
# A job's `billed` mark outlives its deadline by this much (as its worker's progress does).
_BILLED_MARK_GRACE_S = 60
# KEYS: a job's progress hash. ARGV: expiry (s) if the hash has none (the job has not started).
# Marks the job charged by a session manager and returns its published completion and prompt tokens.
_MARK_BILLED = PipeScript("""
redis.call('HSET', KEYS[1], 'billed', '1')
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1])) end
return redis.call('HMGET', KEYS[1], 'completion_tokens', 'prompt_tokens')
""")

# How a session turn's answer is stored, by the request's outcome (anything else: `failed`).
_ANSWER_STATUSES = {
    "stop": "complete",
    "length": "complete",
    "tool_calls": "complete",
    "cancelled": "cancelled",
    "disconnected": "cancelled",
}
# Seeds are 64-bit: choice i's (seed + i) wraps around within them.
_SEED_SPAN = 2**64


async def first_after_cold_start(
    active: ActiveRequest,
    chunks: AsyncIterator[tuple[Choice, TokenChunk]],
    *,
    on_wait: Callable[[], Awaitable[None]] | None,
    metrics: SessionsMetrics,
) -> tuple[Choice, TokenChunk]:
    """The first of `chunks` of a request queued while its model had no live worker, waited for
    until its job's `start_by` (a worker taking the job later skips it), calling `on_wait` every
    `KEEPALIVE_INTERVAL_S` meanwhile.

    Raises:
        Unavailable: `no_worker` with Retry-After, no chunk came by `start_by`.
    """
    job = active.job
    assert job.start_by is not None
    waiting = asyncio.ensure_future(anext(chunks))
    metrics.cold_start_waiting.labels(job.model).inc()
    outcome = "error"
    try:
        while (left_s := job.start_by - time.time()) > 0 and not waiting.done():
            await asyncio.wait((waiting,), timeout=min(left_s, KEEPALIVE_INTERVAL_S))
            if not waiting.done() and on_wait is not None and job.start_by > time.time():
                await on_wait()
        if not waiting.done():
            outcome = "timed_out"
            raise Unavailable(
                f"No worker of model '{job.model}' started within its cold-start wait; try again shortly.",
                retry_after_s=NO_WORKER_RETRY_AFTER_S,
                code="no_worker",
            )
        first = waiting.result()
        outcome = "served"
        return first
    except asyncio.CancelledError:
        outcome = "disconnected"
        raise
    finally:
        if not waiting.done():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        metrics.cold_start_waiting.labels(job.model).dec()
        metrics.cold_start_waits.labels(job.model, outcome).inc()
        log.info("cold_start_wait_ended", outcome=outcome)


def _cold_start(job: Job, body: ChatCompletionRequest | CompletionRequest, wait_s: float) -> Job:
    """`job` queued while its model has no live worker: its requester waits `wait_s` (at most until
    its deadline) for one to start and take it, and the parameters it uses go with it, since no live
    worker could be asked whether it honours them (a worker that does not refuses the job)."""
    start_by = min(job.deadline, time.time() + wait_s)
    return job.model_copy(update={"start_by": start_by, "requires": sorted(body.capabilities_used())})


async def _relayed_to_end(active: ActiveRequest, *, called_off: Callable[[], bool]) -> str:
    """Relay `active`'s chunks, with nobody to send them to, until its final one; returns its
    finish reason, or `disconnected` as soon as `called_off()` (checked at every chunk)."""
    async for _ in active.chunks():
        if called_off():
            return "disconnected"
    return active.choices[0].answer.finish_reason or "stop"


def _for_choice(job: Job, index: int, stream: TokenStream) -> Job:
    """Choice `index`'s job: the first choice's `job` answered on `stream`, with seed + `index`
    when it has a seed."""
    sampling = job.sampling
    if sampling.seed is not None:
        seed = (sampling.seed + index + _SEED_SPAN // 2) % _SEED_SPAN - _SEED_SPAN // 2
        sampling = sampling.model_copy(update={"seed": seed})
    return job.model_copy(update={"job_id": stream.job_id, "channel": stream.channel, "sampling": sampling})


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


def sse_error(exc: AxonError) -> bytes:
    """The end of a stream whose head has gone out: the error as an event, then `[DONE]`."""
    return b"data: " + orjson.dumps(exc.body()) + b"\n\n" + SSE_END
