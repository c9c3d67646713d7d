"""Turns a completion request into a job and relays its chunks back.

Order matters:
- subscribe to the job's token channel, then publish the job, so no chunk can be
  published before someone listens;
- store the answer (Redis + outbox) before the client sees its end, so an answer a
  client received is never missing from its history.
"""

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError
from redis.exceptions import RedisError

from services.sessions.catalog import ModelCatalog, require_supported
from services.sessions.jobs import JobPublisher
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox, UsageRow
from services.sessions.protocol import ResponseBuilder
from services.sessions.relay import STREAM_LOST, TokenRelay, TokenStream
from services.sessions.settings import SessionsSettings
from services.sessions.turns import Turn, Turns
from shared.errors import AxonError, DeadlineExceeded, InvalidRequest, Unavailable, UpstreamError
from shared.logging import bind_contextvars, get_logger
from shared.names import Names
from shared.openai_requests import ChatCompletionRequest, CompletionRequest, Kind
from shared.ratelimit import RateLimiter
from shared.redis_pipe import RedisPipe
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


def chunk_error(chunk: TokenChunk) -> AxonError:
    """The exception a worker's error chunk stands for."""
    message = chunk.error.message if chunk.error else "The worker failed to generate an answer."
    error_type = chunk.error.type if chunk.error else "server_error"
    return _ERROR_TYPES.get(error_type, UpstreamError)(message)


class ActiveJob:
    """A published job whose chunks are being received, deduplicated by `seq`, until its deadline."""

    def __init__(
        self,
        *,
        job: Job,
        caller: Caller,
        stream: TokenStream,
        builder: ResponseBuilder,
        started: float,
        turn: Turn | None,
    ) -> None:
        self.job = job
        self.caller = caller
        self.stream = stream
        self.builder = builder
        self.started = started
        self.turn = turn
        self.finished = False
        self.closed = False
        self.usage: Usage | None = None
        self.text: list[str] = []
        self._next_seq = 0

    def headers(self) -> dict[str, str]:
        return {HISTORY_DROPPED_HEADER: str(self.turn.dropped)} if self.turn else {}

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        """Yield chunks in order until the final one.

        Raises:
            DeadlineExceeded: the job's deadline passed first.
            UpstreamError: the stream was lost (shutdown or a client too slow to keep up).
        """
        while not self.finished:
            remaining_s = self.job.deadline - time.time()
            try:
                if remaining_s <= 0:
                    raise TimeoutError
                raw = await self.stream.next(remaining_s)
            except TimeoutError:
                raise DeadlineExceeded("The request's deadline passed before the answer was complete.") from None
            if raw == STREAM_LOST:
                raise UpstreamError("The answer's stream was interrupted.", code="stream_interrupted")
            try:
                chunk = TokenChunk.model_validate_json(raw)
            except ValidationError:
                log.error("chunk_invalid", size_bytes=len(raw))
                continue
            if chunk.seq < self._next_seq:
                continue  # already relayed: a redelivered job repeats its chunks
            if chunk.seq > self._next_seq:
                log.warning("chunk_gap", expected=self._next_seq, got=chunk.seq)
            self._next_seq = chunk.seq + 1
            self.finished = chunk.is_final
            self.text.append(chunk.text)
            if chunk.usage is not None:
                self.usage = chunk.usage
            yield chunk


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
        self._background = BackgroundTasks()

    def _sampling(self, body: ChatCompletionRequest | CompletionRequest, live: LiveModel) -> Sampling:
        max_tokens = body.requested_max_tokens or min(self._settings.default_max_tokens, live.context_tokens // 2)
        limit = min(self._settings.max_tokens_limit, live.context_tokens)
        if max_tokens > limit:
            raise InvalidRequest(
                f"max_tokens is {max_tokens}, more than this model allows ({limit}).", param="max_tokens"
            )
        defaults = Sampling()
        return Sampling(
            max_tokens=max_tokens,
            temperature=defaults.temperature if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            stop=body.stop_list,
            seed=body.seed,
        )

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
    ) -> ActiveJob:
        """Admit the request and publish its job.

        Raises:
            ModelNotFound, Unavailable, InvalidRequest, NotFound, Conflict: refused before
            any work was queued.
        """
        started = time.perf_counter()
        model, live = await self._catalog.require(body.model)
        require_supported(body, model, live)
        sampling = self._sampling(body, live)
        messages, prompt = self._input(body)
        # A confirmed subscription to a new job's channel, so no chunk of it can be missed.
        stream = await self._relay.open_job()
        bind_contextvars(job_id=stream.job_id)  # the tenant was bound with the caller
        turn: Turn | None = None
        try:
            if isinstance(body, ChatCompletionRequest) and body.session_id is not None:
                assert messages is not None
                turn = await self._turns.begin(
                    tenant=caller.tenant,
                    session_id=body.session_id,
                    job_id=stream.job_id,
                    new_messages=messages,
                    budget_tokens=live.context_tokens - sampling.max_tokens,
                )
                messages = turn.prompt
            job = self._job(
                model, messages=messages, prompt=prompt, sampling=sampling, stream=stream, turn=turn, caller=caller
            )
            await self._publisher.publish(job, priority=caller.priority, request_id=request_id)
        except BaseException as exc:
            await self._withdraw(stream, turn, exc)
            raise
        if turn is not None:
            await self._record_question(turn, stream)
        self._metrics.jobs_published.labels(model).inc()
        self._metrics.active_streams.inc()
        builder = ResponseBuilder(kind=kind, job_id=job.job_id, model=body.model)
        return ActiveJob(job=job, caller=caller, stream=stream, builder=builder, started=started, turn=turn)

    def _input(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[list[Message] | None, str | None]:
        """The request's messages (a chat, checked) or its prompt (a completion)."""
        if isinstance(body, ChatCompletionRequest):
            messages = [m.to_message() for m in body.messages]
            self._check_messages(messages)
            return messages, None
        return None, body.prompt_text

    def _job(
        self,
        model: str,
        *,
        messages: list[Message] | None,
        prompt: str | None,
        sampling: Sampling,
        stream: TokenStream,
        turn: Turn | None,
        caller: Caller,
    ) -> Job:
        """The job to publish, answered on `stream`'s channel."""
        return Job(
            job_id=stream.job_id,
            model=model,
            messages=messages,
            prompt=prompt,
            sampling=sampling,
            channel=stream.channel,
            deadline=time.time() + self._settings.request_timeout_s,
            session_id=turn.info.id if turn else None,
            tenant=caller.tenant,
        )

    async def _withdraw(self, stream: TokenStream, turn: Turn | None, exc: BaseException) -> None:
        """Undo a start that failed (`exc`) before its job was surely queued: close its stream,
        release its session, and call the job off if it may be queued after all."""
        await stream.close()
        if turn is not None:
            await self._turns.abandon(turn)
        if isinstance(exc, Unavailable) and exc.code != "queue_full":
            # Unconfirmed, the job may still be queued (the broker went away before its confirm):
            # workers skip a job they were told was cancelled, so none answers it for nobody.
            self._cancel(stream.job_id).add_done_callback(_retrieved)

    async def _record_question(self, turn: Turn, stream: TokenStream) -> None:
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

    async def first_chunk(self, active: ActiveJob) -> tuple[TokenChunk, AsyncIterator[TokenChunk]]:
        """Wait for the first chunk, so failures before any token get a real status code."""
        chunks = active.chunks()
        try:
            first = await anext(chunks)
            if first.finish_reason == "error":
                raise chunk_error(first)
        except asyncio.CancelledError:
            await asyncio.shield(self.finish(active, outcome="disconnected"))
            raise
        except BaseException:
            await self.finish(active, outcome="error")
            raise
        self._metrics.ttft.labels(active.job.model).observe(time.perf_counter() - active.started)
        return first, chunks

    async def collect(self, active: ActiveJob, first: TokenChunk, rest: AsyncIterator[TokenChunk]) -> dict[str, Any]:
        """Gather the whole answer into one OpenAI response object (stored before it is returned)."""
        last = first
        try:
            if not first.is_final:
                async for chunk in rest:
                    last = chunk
            if last.finish_reason == "error":
                raise chunk_error(last)
        except asyncio.CancelledError:
            await asyncio.shield(self.finish(active, outcome="disconnected"))
            raise
        except BaseException:
            await self.finish(active, outcome="error")
            raise
        await self.finish(active, outcome=last.finish_reason or "stop")
        usage = last.usage
        return active.builder.response(
            "".join(active.text),
            last.finish_reason or "stop",
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
        )

    async def sse(
        self,
        active: ActiveJob,
        first: TokenChunk,
        rest: AsyncIterator[TokenChunk],
        *,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """Relay chunks as OpenAI server-sent events, ending with `data: [DONE]`.

        Events of chunks that arrived together go out as one piece (one socket write), and the
        last chunk's event, the usage event and `[DONE]` as one.
        """
        builder = active.builder
        inter_token = self._metrics.inter_token.labels(active.job.model)
        outcome = "disconnected"
        last_at = time.perf_counter()
        events: list[bytes] = []
        try:
            chunk = first
            is_first = True
            while True:
                if chunk.finish_reason == "error":
                    raise chunk_error(chunk)
                if chunk.is_final:
                    outcome = chunk.finish_reason or "stop"
                    await self.finish(active, outcome=outcome)  # stored before the client sees the end
                if chunk.text or chunk.is_final or is_first:
                    events.append(
                        _sse(builder.chunk(chunk.text, chunk.finish_reason, first=is_first, usage_field=include_usage))
                    )
                    is_first = False
                if chunk.is_final:
                    break
                if events and not active.stream.ready:
                    yield b"".join(events)
                    events.clear()
                chunk = await anext(rest)
                now = time.perf_counter()
                inter_token.observe(now - last_at)
                last_at = now
            if include_usage and chunk.usage is not None:
                events.append(_sse(builder.usage_chunk(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)))
            events.append(SSE_END)
            yield b"".join(events)
        except AxonError as exc:
            outcome = "error"
            log.warning("stream_failed", error=exc.message)
            await self.finish(active, outcome=outcome)
            yield b"".join([*events, _sse(exc.body()), SSE_END])
        finally:
            if outcome == "disconnected":
                # In its own task: this one may itself be cancelled (client gone), and the
                # cancel notice must still go out.
                self._background.spawn(self.finish(active, outcome=outcome))

    async def finish(self, active: ActiveJob, *, outcome: str) -> None:
        """Stop relaying (once): store the answer and usage, release the session, and if the
        answer was not complete, tell the workers to stop generating it.

        Raises:
            Unavailable: a complete answer of a session turn could not be stored (Redis away):
                its client must not take it for saved.
        """
        if active.closed:
            return
        active.closed = True
        self._metrics.active_streams.dec()
        self._metrics.outcomes.labels(active.job.model, outcome).inc()
        await active.stream.close()
        # Submitted now, it goes out before the history is written.
        cancel = None if active.finished else self._cancel(active.job.job_id)
        not_stored: Exception | None = None
        if active.turn is not None:
            status = {"stop": "complete", "length": "complete", "cancelled": "cancelled"}.get(outcome, "failed")
            if outcome == "disconnected":
                status = "cancelled"
            try:
                await self._turns.record_answer(active.turn, text="".join(active.text), status=status)
            except _STORAGE_ERRORS as exc:
                log.error("answer_not_stored", error=repr(exc))
                not_stored = exc
        if active.usage is not None:
            self._metrics.output_tokens.labels(active.job.model).inc(active.usage.completion_tokens)
        await self._bill_and_release(active, cancel)
        if not_stored is not None and outcome in ("stop", "length"):
            raise _history_unavailable() from not_stored

    async def _bill_and_release(self, active: ActiveJob, cancel: asyncio.Future[Any] | None) -> None:
        """The answer's bookkeeping, in one Redis write: its usage row, the charge of its real token
        use (correcting the gateway's estimate) and the release of the caller's concurrency lease;
        then the outcome of those and of the cancel notice. None of it may fail the answer."""
        writes: dict[str, asyncio.Future[Any]] = {"cancel_publish": cancel} if cancel is not None else {}
        job, caller, usage = active.job, active.caller, active.usage
        if usage is not None:
            row = UsageRow(
                job_id=job.job_id,
                tenant=caller.tenant,
                key_id=caller.key_id,
                model=job.model,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                latency_ms=int((time.perf_counter() - active.started) * 1000),
                created_at=dt.datetime.now(dt.UTC),
            )
            writes["usage_record"] = self._pipe.submit(*self._outbox.append_command("usage", row))
            cost = usage.completion_tokens + usage.prompt_tokens - caller.prompt_estimate
            if caller.key_id is not None and caller.tpm_limit and cost:
                writes["token_charge"] = self._limiter.submit_charge(caller.key_id, caller.tpm_limit, cost)
        if caller.key_id is not None and caller.lease_id is not None:
            writes["lease_release"] = self._limiter.submit_release(caller.key_id, caller.lease_id)
        results = await asyncio.gather(*writes.values(), return_exceptions=True)
        for what, result in zip(writes, results, strict=True):
            if isinstance(result, Exception):
                log.warning(f"{what}_failed", error=repr(result))


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


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
