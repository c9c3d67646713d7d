"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the chat completion
machinery: a Messages request runs as one chat completion (`MessageCreate.chat_request`) through
`CompletionService` (the same admission, job, fair share, relay, failover and usage accounting),
and its answer is translated into a `Message`, whole or as Anthropic's stream events
(`messages/protocol.py`). Nothing is stored: the Messages API keeps no state.
"""

import time
from collections.abc import AsyncIterator
from typing import Any

from services.sessions.active_request import ActiveRequest, Choice, chunk_error
from services.sessions.completions import CompletionService
from services.sessions.messages.protocol import MessageEvents, error_event, message_object
from services.sessions.metrics import SessionsMetrics
from shared.errors import AxonError, InvalidRequest
from shared.internal_headers import Caller
from shared.logging import get_logger
from shared.messages_requests import CountTokensRequest, MessageCreate, as_messages_error
from shared.openai_requests import ChatCompletionRequest, RequestLimits
from shared.schemas import TokenChunk, Usage

log = get_logger(__name__)

Chunks = AsyncIterator[tuple[Choice, TokenChunk]]


class MessagesService:
    """Answers Messages requests on `CompletionService`, whole or streamed, and counts their tokens."""

    def __init__(self, *, completions: CompletionService, limits: RequestLimits, metrics: SessionsMetrics) -> None:
        self.completions = completions
        self._limits = limits
        self._metrics = metrics

    def chat_request(self, body: MessageCreate | CountTokensRequest) -> ChatCompletionRequest:
        """The chat completion `body` runs as, checked.

        Raises:
            InvalidRequest: a field breaks a rule (`param` names it, in the Messages body's terms).
        """
        return body.chat_request(self._limits)

    async def start(
        self,
        body: MessageCreate | CountTokensRequest,
        *,
        caller: Caller,
        request_id: str,
        cold_start_wait_s: float | None = None,
        timeout_s: float | None = None,
    ) -> ActiveRequest:
        """Check `body` and publish its job (`CompletionService.start`: `cold_start_wait_s` and
        `timeout_s` as there; a `CountTokensRequest`'s only counts). A 400 names the Messages
        body's field.

        Raises:
            InvalidRequest, ModelNotFound, Unavailable: refused before any work was queued.
        """
        chat = self.chat_request(body)
        try:
            return await self.completions.start(
                chat,
                kind="chat",
                caller=caller,
                request_id=request_id,
                cold_start_wait_s=cold_start_wait_s,
                timeout_s=timeout_s,
                count_only=isinstance(body, CountTokensRequest),
            )
        except InvalidRequest as exc:
            raise as_messages_error(exc) from None

    async def create(
        self,
        body: MessageCreate,
        *,
        caller: Caller,
        request_id: str,
        cold_start_wait_s: float | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Answer `body` whole: its `Message` (a Message Batch's request is answered by this too).

        Raises:
            InvalidRequest, ModelNotFound, Unavailable: refused before any work was queued.
            UpstreamError, DeadlineExceeded: the answer failed.
        """
        active = await self.start(
            body, caller=caller, request_id=request_id, cold_start_wait_s=cold_start_wait_s, timeout_s=timeout_s
        )
        first, rest = await self.completions.first_chunk(active)
        return await self.collect(body, active, first, rest)

    async def collect(
        self, body: MessageCreate, active: ActiveRequest, first: tuple[Choice, TokenChunk], rest: Chunks
    ) -> dict[str, Any]:
        """Gather the answer after its `first` chunk into one `Message`.

        Raises:
            UpstreamError, DeadlineExceeded: the answer failed (its job is called off).
        """
        choice, chunk = await self.completions.gather(active, first, rest)
        return message_object(
            job_id=active.job.job_id,
            model=body.model,
            answer=choice.answer,
            usage=active.usage,
            stop_sequence=chunk.stop_sequence,
        )

    async def stream(
        self, body: MessageCreate, active: ActiveRequest, first: tuple[Choice, TokenChunk], rest: Chunks
    ) -> AsyncIterator[bytes]:
        """Relay the answer as Anthropic's stream events, from `message_start` to `message_stop`
        (or an `error` event); events of chunks that arrived together go out as one piece. A
        client that leaves calls the job off."""
        events = MessageEvents(job_id=active.job.job_id, model=body.model)
        inter_token = self._metrics.inter_token.labels(active.job.model)
        outcome = "disconnected"
        last_at = time.perf_counter()
        chunk = first[1]
        pieces = events.opening(chunk.usage)
        try:
            while True:
                if chunk.finish_reason == "error":
                    raise chunk_error(chunk)
                if chunk.text or chunk.tool_calls:
                    pieces += events.chunk(chunk.text, chunk.tool_calls)
                if not active.unfinished:
                    break
                if pieces and not active.stream.ready:
                    yield b"".join(pieces)
                    pieces = []
                _, chunk = await anext(rest)
                now = time.perf_counter()
                inter_token.observe(now - last_at)
                last_at = now
            outcome = chunk.finish_reason or "stop"
            await self.completions.finish(active, outcome=outcome)
            pieces += events.closing(reason=chunk.finish_reason, usage=active.usage, stop_sequence=chunk.stop_sequence)
            yield b"".join(pieces)
        except AxonError as exc:
            outcome = "error"
            log.warning("stream_failed", error=exc.message)
            await self.completions.finish(active, outcome=outcome)
            yield b"".join([*pieces, error_event(exc)])
        finally:
            if outcome == "disconnected":
                # In its own task: this one may itself be cancelled (client gone), and the
                # cancel notice must still go out.
                self.completions.finish_later(active, outcome=outcome)

    async def count_tokens(self, body: CountTokensRequest, *, caller: Caller, request_id: str) -> dict[str, Any]:
        """`{"input_tokens": n}`: the prompt's tokens as the model's engine counts them (its
        tokenizer and chat template, tools included), from a count-only job (`Job.count_only`: a
        worker of the model tokenizes the prompt and generates nothing). Like Anthropic's, a count
        costs a request of the key's limits and no tokens: its usage is settled as zero.

        Raises:
            InvalidRequest, ModelNotFound, Unavailable: refused before any work was queued.
            UpstreamError, DeadlineExceeded: the engine did not answer.
        """
        active = await self.start(body, caller=caller, request_id=request_id)
        async with self.completions.finished_if_failed(active):
            # A count's only chunk is its final one (not a first token: no TTFT is observed).
            choice, chunk = await self.completions.first_of(active, active.chunks())
            if chunk.finish_reason == "error":
                raise chunk_error(chunk)
        counted = choice.answer.usage.prompt_tokens if choice.answer.usage is not None else 0
        choice.answer.usage = Usage()  # counted, not charged
        await self.completions.finish(active, outcome=chunk.finish_reason or "stop")
        return {"input_tokens": counted}
