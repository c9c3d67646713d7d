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
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import redis.asyncio as redis
from pydantic import ValidationError

from shared.errors import AxonError, DeadlineExceeded, InvalidRequest, UpstreamError
from shared.logging import bind_contextvars, get_logger
from shared.names import Names
from shared.outbox import Outbox, UsageRow
from shared.ratelimit import RateLimiter
from shared.registry import LiveModel
from shared.schemas import Job, Message, Sampling, TokenChunk, Usage
from shared.tasks import BackgroundTasks
from services.sessions.catalog import ModelCatalog
from services.sessions.jobs import JobPublisher
from services.sessions.metrics import SessionsMetrics
from services.sessions.protocol import ChatCompletionRequest, CompletionRequest, Kind, ResponseBuilder
from services.sessions.relay import STREAM_LOST, TokenRelay, TokenStream
from services.sessions.settings import SessionsSettings
from services.sessions.turns import Turn, Turns

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
                raise UpstreamError("The answer's stream was interrupted.")
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
        client: redis.Redis,
        limiter: RateLimiter,
        outbox: Outbox,
        turns: Turns,
        metrics: SessionsMetrics,
    ) -> None:
        self._settings = settings
        self._names = Names(settings.namespace)
        self._catalog = catalog
        self._relay = relay
        self._publisher = publisher
        self._redis = client
        self._limiter = limiter
        self._outbox = outbox
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
        sampling = self._sampling(body, live)
        job_id = str(uuid.uuid4())
        bind_contextvars(job_id=job_id, tenant=caller.tenant)
        turn: Turn | None = None
        messages: list[Message] | None = None
        prompt: str | None = None
        if isinstance(body, ChatCompletionRequest):
            messages = [m.to_message(i) for i, m in enumerate(body.messages)]
            self._check_messages(messages)
            if body.session_id is not None:
                turn = await self._turns.begin(
                    tenant=caller.tenant, session_id=body.session_id, job_id=job_id, new_messages=messages,
                    budget_tokens=live.context_tokens - sampling.max_tokens,
                )  # fmt: skip
                messages = turn.prompt
        else:
            prompt = body.prompt_text
        job = Job(
            job_id=job_id, model=model, messages=messages, prompt=prompt, sampling=sampling,
            channel=self._names.tokens_channel(job_id), deadline=time.time() + self._settings.request_timeout_s,
            session_id=turn.info.id if turn else None, tenant=caller.tenant,
        )  # fmt: skip
        try:
            stream = await self._relay.open(job.channel)
            try:
                await self._publisher.publish(job, priority=caller.priority, request_id=request_id)
            except BaseException:
                await stream.close()
                raise
        except BaseException:
            if turn is not None:
                await self._turns.abandon(turn)
            raise
        if turn is not None:
            await self._turns.record_question(turn)
        self._metrics.jobs_published.labels(model).inc()
        self._metrics.active_streams.inc()
        builder = ResponseBuilder(kind=kind, job_id=job.job_id, model=body.model)
        return ActiveJob(job=job, caller=caller, stream=stream, builder=builder, started=started, turn=turn)

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

    async def collect(self, active: ActiveJob, first: TokenChunk, rest: AsyncIterator[TokenChunk]) -> dict:
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
        """Relay chunks as OpenAI server-sent events, ending with `data: [DONE]`."""
        builder = active.builder
        model = active.job.model
        outcome = "disconnected"
        last_at = time.perf_counter()
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
                    yield _sse(builder.chunk(chunk.text, chunk.finish_reason, first=is_first, usage_field=include_usage))
                    is_first = False
                if chunk.is_final:
                    break
                chunk = await anext(rest)
                now = time.perf_counter()
                self._metrics.inter_token.labels(model).observe(now - last_at)
                last_at = now
            if include_usage and chunk.usage is not None:
                yield _sse(builder.usage_chunk(chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
            yield b"data: [DONE]\n\n"
        except AxonError as exc:
            outcome = "error"
            log.warning("stream_failed", error=exc.message)
            await self.finish(active, outcome=outcome)
            yield _sse(exc.body())
            yield b"data: [DONE]\n\n"
        finally:
            if outcome == "disconnected":
                # In its own task: this one may itself be cancelled (client gone), and the
                # cancel notice must still go out.
                self._background.spawn(self.finish(active, outcome=outcome))

    async def finish(self, active: ActiveJob, *, outcome: str) -> None:
        """Stop relaying (once): store the answer and usage, release the session, and if the
        answer was not complete, tell the workers to stop generating it."""
        if active.closed:
            return
        active.closed = True
        self._metrics.active_streams.dec()
        self._metrics.outcomes.labels(active.job.model, outcome).inc()
        await active.stream.close()
        if not active.finished:
            try:
                await self._redis.publish(self._names.cancel_channel, active.job.job_id)
            except Exception as exc:  # noqa: BLE001 - best effort: the deadline bounds the work anyway
                log.warning("cancel_publish_failed", error=repr(exc))
        if active.turn is not None:
            status = {"stop": "complete", "length": "complete", "cancelled": "cancelled"}.get(outcome, "failed")
            if outcome == "disconnected":
                status = "cancelled"
            await self._turns.record_answer(active.turn, text="".join(active.text), status=status)
        if active.usage is not None:
            self._metrics.output_tokens.labels(active.job.model).inc(active.usage.completion_tokens)
            await self._record_usage(active)
            await self._settle_tokens(active)

    async def _record_usage(self, active: ActiveJob) -> None:
        usage = active.usage
        assert usage is not None
        row = UsageRow(
            job_id=active.job.job_id, tenant=active.caller.tenant, key_id=active.caller.key_id,
            model=active.job.model, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            latency_ms=int((time.perf_counter() - active.started) * 1000), created_at=dt.datetime.now(dt.UTC),
        )  # fmt: skip
        try:
            await self._outbox.append("usage", row)
        except Exception as exc:  # noqa: BLE001 - accounting must not fail the answer
            log.warning("usage_record_failed", error=repr(exc))

    async def _settle_tokens(self, active: ActiveJob) -> None:
        """Charge the key's token budget with real usage, correcting the gateway's prompt estimate."""
        caller, usage = active.caller, active.usage
        if caller.key_id is None or not caller.tpm_limit or usage is None:
            return
        cost = usage.completion_tokens + usage.prompt_tokens - caller.prompt_estimate
        try:
            await self._limiter.charge_tokens(caller.key_id, caller.tpm_limit, cost)
        except Exception as exc:  # noqa: BLE001 - accounting must not fail the answer
            log.warning("token_charge_failed", error=repr(exc))


def _sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
