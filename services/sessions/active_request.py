"""A request whose jobs (one per choice) are published, and the one reader of their chunks.

Every chunk a session manager receives passes `ActiveRequest.receive`: it drops what a choice
already had (a redelivered job repeats its chunks from seq 0, a takeover's log replays them) and
adds the rest to the choice's answer. `chunks` reads a request to its end for its client;
`finals` reads what is left of one its client no longer waits for, only to learn what it cost.
"""

import time
from collections.abc import AsyncIterator

from pydantic import ValidationError

from services.sessions.chat.protocol import Answer, ResponseBuilder
from services.sessions.chunk_log import LoggedStream
from services.sessions.relay import STREAM_LOST, MergedStream, TokenStream
from services.sessions.turns import Turn
from shared.errors import AxonError, DeadlineExceeded, InvalidRequest, UpstreamError
from shared.internal_headers import HISTORY_DROPPED_HEADER, Caller
from shared.logging import get_logger
from shared.schemas import Job, TokenChunk, Usage
from shared.tracing import link_current_span

log = get_logger(__name__)

_ERROR_TYPES: dict[str, type[AxonError]] = {
    "timeout_error": DeadlineExceeded,
    "invalid_request_error": InvalidRequest,
}


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
        # The worker whose own queue its job went to by the prefix index's routing (None: another route).
        self.worker: str | None = None
        self.usage: Usage | None = None
        # The stream ended before its chunks did (STREAM_LOST): nothing more arrives on it.
        self.lost = False

    def headers(self) -> dict[str, str]:
        return {HISTORY_DROPPED_HEADER: str(self.turn.dropped)} if self.turn else {}

    def receive(self, raw: bytes) -> tuple[Choice, TokenChunk] | None:
        """Take one message of the stream into its choice's answer; returns the choice and the
        chunk, or None for one to skip (malformed, or a seq the choice already had). A final chunk
        also settles its choice's usage and finish reason, once."""
        try:
            chunk = TokenChunk.model_validate_json(raw)
        except ValidationError:
            log.error("chunk_invalid", size_bytes=len(raw))
            return None
        choice = self.choices[self.stream.index]
        if chunk.seq < choice.next_seq:
            return None  # already received: a redelivered job repeats its chunks
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
            if chunk.traceparent is not None:
                link_current_span(chunk.traceparent, why="worker")
        return choice, chunk

    async def chunks(self) -> AsyncIterator[tuple[Choice, TokenChunk]]:
        """Yield each choice's chunks in order (choices interleaved as they arrive) until every
        choice's final one.

        Raises:
            DeadlineExceeded: the job's deadline passed first.
            UpstreamError: the stream was lost (shutdown or a client too slow to keep up).
        """
        deadline = self.job.deadline
        while self.unfinished:
            remaining_s = deadline - time.time()
            try:
                if remaining_s <= 0:
                    raise TimeoutError
                raw = await self.stream.next(remaining_s)
            except TimeoutError:
                raise DeadlineExceeded("The request's deadline passed before the answer was complete.") from None
            if raw == STREAM_LOST:
                self.lost = True
                raise UpstreamError("The answer's stream was interrupted.", code="stream_interrupted")
            received = self.receive(raw)
            if received is not None:
                yield received

    async def finals(self, unfinished: list[Choice], wait_s: float) -> list[Choice]:
        """Read on until every choice of `unfinished` has its final chunk (which carries what its
        job generated), for up to `wait_s` (not at all once the stream is lost); returns those
        whose final chunk did not come."""
        waiting = {c.index for c in unfinished if c.answer.finish_reason is None}
        until = time.monotonic() + wait_s
        while waiting and not self.lost:
            try:
                raw = await self.stream.next(until - time.monotonic())
            except TimeoutError:
                break
            if raw == STREAM_LOST:
                self.lost = True
                break
            received = self.receive(raw)
            if received is not None and received[1].finish_reason is not None:
                waiting.discard(received[0].index)
        return [c for c in unfinished if c.index in waiting]
