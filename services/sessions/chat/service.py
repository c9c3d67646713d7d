"""Chat and text completions (`/v1/chat/completions`, `/v1/completions`): a completion's answer
gathered into one response object, or relayed as server-sent events; a streamed session turn whose
client leaves runs on to its end (`RunOn`), stored whole in its session and resumable.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from redis.exceptions import RedisError

from services.sessions.active_request import ActiveRequest, Choice, chunk_error
from services.sessions.chunk_log import ChunkLog, LoggedStream
from services.sessions.completions import CompletionService
from services.sessions.metrics import SessionsMetrics
from services.sessions.run_on import RunOn
from services.sessions.sse import USAGE_EVENT_ID, sse_error, sse_event, sse_named_event
from shared.errors import AxonError, Unavailable, UpstreamError
from shared.http_responses import SSE_END
from shared.logging import get_logger
from shared.schemas import TokenChunk

log = get_logger(__name__)


class ChatService:
    """Answers chat and text completions on `CompletionService`, whole or streamed."""

    def __init__(
        self,
        *,
        completions: CompletionService,
        run_on: RunOn,
        chunk_log: ChunkLog | None,
        metrics: SessionsMetrics,
    ) -> None:
        self._completions = completions
        self._run_on = run_on
        # Where a session turn whose relayed stream was lost reads on (`_relay_detached`).
        self._chunk_log = chunk_log
        self._metrics = metrics

    async def collect(
        self, active: ActiveRequest, first: tuple[Choice, TokenChunk], rest: AsyncIterator[tuple[Choice, TokenChunk]]
    ) -> dict[str, Any]:
        """Gather the whole answer into one OpenAI response object (stored before it is returned)."""
        await self._completions.gather(active, first, rest)
        return active.builder.response([c.answer for c in active.choices], active.usage)

    async def sse(
        self, active: ActiveRequest, first: tuple[Choice, TokenChunk], rest: AsyncIterator[tuple[Choice, TokenChunk]]
    ) -> AsyncIterator[bytes]:
        """Relay chunks as OpenAI server-sent events (each with its choice's index), ending with
        `data: [DONE]`.

        Events of chunks that arrived together go out as one piece (one socket write), and the
        last chunk's event, the usage event and `[DONE]` as one. Each event has its `id:`
        (`chat/protocol.py`). A resumable session turn whose client leaves goes on to its end
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
                        await self._completions.finish(active, outcome=outcome)  # stored before the client sees the end
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
                await self._completions.finish(active, outcome=outcome)
            yield b"".join([*events, sse_error(exc)])
        finally:
            if outcome == "disconnected":
                # In its own task: this one may itself be cancelled (client gone), and the
                # cancel notice must still go out.
                if active.turn is not None and active.job.chunk_log_ttl_s is not None:
                    self._run_on.run_on(self._relay_detached(active))
                else:
                    self._completions.finish_later(active, outcome=outcome)

    def _reads_on_from_log(self, active: ActiveRequest) -> bool:
        """Whether a session turn whose relayed stream was lost (Redis dropped the relay's
        connection, a slow client's buffer overflowed) reads the rest from its job's chunk log,
        rather than being called off: it keeps one, and the process is not stopping."""
        return (
            active.turn is not None
            and active.job.chunk_log_ttl_s is not None
            and self._chunk_log is not None
            and not self._run_on.called_off
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
                outcome = await _relayed_to_end(active, called_off=self._called_off_now)
            except UpstreamError:
                if not active.lost:  # lost now: the rest is in the log
                    raise
                await self._read_on_from_log(active)
                outcome = await _relayed_to_end(active, called_off=self._called_off_now)
        except (AxonError, RedisError) as exc:
            log.warning("stream_failed", error=repr(exc))
            outcome = "error"
        except asyncio.CancelledError:
            await asyncio.shield(self._completions.finish(active, outcome="disconnected"))
            raise
        with contextlib.suppress(Unavailable):  # not stored: `finish` logged it
            await self._completions.finish(active, outcome=outcome)

    def _called_off_now(self) -> bool:
        """The stop's deadline passed: turns relayed on after their clients left end now, as
        cancelled (their task's cancellation alone did not always reach a turn following its log)."""
        return self._run_on.called_off

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


async def _relayed_to_end(active: ActiveRequest, *, called_off: Callable[[], bool]) -> str:
    """Relay `active`'s chunks, with nobody to send them to, until its final one; returns its
    finish reason, or `disconnected` as soon as `called_off()` (checked at every chunk)."""
    async for _ in active.chunks():
        if called_off():
            return "disconnected"
    return active.choices[0].answer.finish_reason or "stop"
