"""A stored response's events, replayed from its job's chunk log after a given `sequence_number`
(`GET /v1/responses/{id}?stream=true&starting_after=N`, and a background response's stream), then
followed live while it is unfinished, from any replica."""

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from services.sessions.chunk_log import PAGE, ChunkLog
from services.sessions.cold_start import KEEPALIVE_INTERVAL_S
from services.sessions.responses.events import (
    ResponseEvents,
    beating,
    check_after,
    counted_events,
    error_event,
    events_after,
    most_events,
    past_the_end,
)
from services.sessions.responses.protocol import finished_response, response_not_found, skeleton_of, status_of
from services.sessions.responses.store import ResponseStore, StoredResponse
from services.sessions.settings import SessionsSettings
from services.sessions.sse import SSE_KEEPALIVE
from shared.errors import InvalidRequest
from shared.schemas import TokenChunk

# How long a follower past a job's deadline waits for its last chunk (a worker's error chunk).
DEADLINE_GRACE_S = 5.0
# Events a replay sends in one piece.
_REPLAY_PAGE = 512


class ResponseReplays:
    """Replays stored responses' events (see the module's docstring)."""

    def __init__(
        self, *, settings: SessionsSettings, store: ResponseStore, chunk_log: ChunkLog, lease_s: float
    ) -> None:
        self._settings = settings
        self._store = store
        self._log = chunk_log
        # A response unfinished that long past its lease's expiry was not finished by anyone.
        self._lease_s = lease_s
        # A followed response's stream sends a keep-alive comment when nothing came for this long
        # (a queued job, a worker starting): the gateway's and a load balancer's idle timeouts.
        self.keepalive_s = KEEPALIVE_INTERVAL_S

    async def logged(self, job_id: str) -> list[TokenChunk]:
        """Every chunk of `job_id`'s log so far, in order."""
        chunks: list[TokenChunk] = []
        after = -1
        while True:
            page = await self._log.read(job_id, after, PAGE)
            chunks += page
            if len(page) < PAGE:
                return chunks
            after = page[-1].seq

    async def stored(self, tenant: str, response_id: str) -> StoredResponse:
        stored = await self._store.get(tenant, response_id)
        if stored is None:
            raise response_not_found()
        return stored

    async def replay(self, tenant: str, response_id: str, *, starting_after: int | None) -> AsyncGenerator[bytes]:
        """The stored response's events with a sequence_number past `starting_after` (all without
        it), rebuilt from its job's chunk log, then, while it is unfinished, followed live to its
        end. The checks are done before the first piece is asked for.

        Raises:
            NotFound: unknown, expired, deleted or another tenant's.
            InvalidRequest: its events are not kept (expired log, or stored before logs), or
                `starting_after` is at or past the end of one whose end is known: a finished
                one, or one whose log holds its final chunk (its finisher is storing it). Past
                the end of one that ends only later, the stream is an `error` event alone.
        """
        stored = await self.stored(tenant, response_id)
        if stored.job_id is None:
            raise InvalidRequest(
                "This response's events were not kept, so it cannot be streamed; retrieve it without stream.",
                param="stream",
                code="stream_unavailable",
            )
        chunks = await self.logged(stored.job_id)
        after = -1 if starting_after is None else starting_after
        if stored.pending is not None:
            if after >= 0 and (chunks and chunks[-1].finish_reason is not None):  # its end is known
                counted = counted_events(stored.response, chunks)
                status = status_of(counted.finish_reason)
                output = counted.output(status)
                counted.closing(finished_response(stored.response, status=status, output=output, usage=None))
                check_after(after, counted.seq)
            return self._events(response_id, stored, chunks, after)
        last_seq = stored.last_seq if stored.last_seq is not None else -1
        chunks = [chunk for chunk in chunks if chunk.seq <= last_seq]
        counted = counted_events(stored.response, chunks)
        if counted.last_seq < last_seq:
            raise InvalidRequest(
                f"This response's events are kept for {self._settings.stream_log_ttl_s} s after its last "
                "one, and they are gone; retrieve it without stream.",
                param="stream",
                code="stream_expired",
            )
        counted.closing(stored.response)
        check_after(after, counted.seq)
        return self._events(response_id, stored, chunks, after)

    async def _events(
        self, response_id: str, stored: StoredResponse, chunks: list[TokenChunk], after: int
    ) -> AsyncGenerator[bytes]:
        """The events past `after` of the response whose logged chunks are `chunks`, a piece per
        `_REPLAY_PAGE` events (the events up to `after` are counted, not built); then, for an
        unfinished one, its chunks as they are logged, and its end once it is stored finished."""
        events = ResponseEvents(skeleton_of(stored.response))
        out = events_after(events, events.opening(), after)
        for chunk in chunks:
            events.quiet = events.seq + most_events(chunk) <= after
            out += events_after(events, events.chunk(chunk), after)
            if len(out) >= _REPLAY_PAGE:
                yield b"".join(out)
                out = []
        events.quiet = False
        if stored.pending is None:
            yield b"".join([*out, *events_after(events, events.closing(stored.response), after)])
            return
        assert stored.job_id is not None
        if out:
            yield b"".join(out)
        idle_s = max(0.0, stored.pending.deadline - time.time()) + DEADLINE_GRACE_S
        with contextlib.suppress(TimeoutError):
            if events.finish_reason is None:  # the log may hold the final chunk already
                pages = self._log.pages(stored.job_id, events.last_seq, idle_timeout_s=idle_s)
                async for page in beating(pages, self.keepalive_s):
                    if page is None:
                        yield SSE_KEEPALIVE
                        continue
                    new = []
                    for chunk in page:
                        new += events_after(events, events.chunk(chunk), after)
                    if new:
                        yield b"".join(new)
        final = await self._finished(response_id)
        if final is None:
            return
        if end := events_after(events, events.closing(final), after):
            yield b"".join(end)
        else:  # nothing was past `after`: the 400 of a finished one, as an event (the head went out)
            yield error_event(past_the_end(after, events.seq), events.seq)

    async def _finished(self, response_id: str) -> dict[str, Any] | None:
        """The response once its finisher stored it (whoever relays it, or takes it over once its
        lease expires), or None if that does not happen within three leases."""
        until = time.monotonic() + 3 * self._lease_s + DEADLINE_GRACE_S
        while time.monotonic() < until:
            stored = await self._store.get_any(response_id)
            if stored is None:
                return None
            if stored.pending is None:
                return stored.response
            await asyncio.sleep(0.05)
        return None
