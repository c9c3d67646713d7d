"""`GET /v1/chat/completions/{completion_id}/stream`: the rest of a session turn's chat stream, for a
client whose connection dropped (an Axon extension).

The events are rebuilt from the job's chunk log (`chunk_log.py`) exactly as the session manager that
relayed the job built them (`ChatService.sse`): the same ids, `created`, `model`, deltas and
usage event, so the events before `Last-Event-ID` and those after it make the one stream. The log
outlives that session manager, and a running job is followed live, so any replica answers.
"""

import re
import time
from collections.abc import AsyncIterator

import orjson
from redis.exceptions import RedisError

from services.sessions.active_request import chunk_error
from services.sessions.chat.protocol import ResponseBuilder, has_event
from services.sessions.chunk_log import ChunkLog, StreamMeta
from services.sessions.sse import sse_event
from shared.errors import AxonError, InvalidRequest, NotFound, UpstreamError
from shared.http_responses import SSE_END
from shared.logging import get_logger
from shared.schemas import TokenChunk
from shared.tracing import link_current_span

log = get_logger(__name__)

# A job's last chunk may come this long after its deadline (the worker's own deadline error).
FINAL_GRACE_S = 10.0
COMPLETION_ID_PREFIX = "chatcmpl-"
_EVENT_ID = re.compile(r"-1|0|[1-9][0-9]{0,17}")


def _starting_after(starting_after: str | None, last_event_id: str | None) -> int:
    """The seq the client has the events up to: `starting_after` if given, else `Last-Event-ID`,
    else -1 (from the start).

    Raises:
        InvalidRequest: not an event id of a chat stream (a whole number, at least -1).
    """
    param, value = (
        ("starting_after", starting_after) if starting_after is not None else ("Last-Event-ID", last_event_id)
    )
    if value is None:
        return -1
    if not _EVENT_ID.fullmatch(value.strip()):
        raise InvalidRequest(f"{param} must be the id of an event of the stream (a whole number).", param=param)
    return int(value)


async def open_chat_stream(
    chunk_log: ChunkLog, completion_id: str, *, tenant: str, starting_after: str | None, last_event_id: str | None
) -> AsyncIterator[bytes]:
    """The events of the stream `completion_id` after the one the client names, ending with
    `[DONE]`; checked before any is sent.

    Raises:
        NotFound: no resumable stream of that id is kept for `tenant` (unknown, another
            tenant's, not a session turn's stream, or expired).
        InvalidRequest: the event id is malformed or past the stream's end.
    """
    job_id = completion_id.removeprefix(COMPLETION_ID_PREFIX)
    meta = await chunk_log.meta(job_id) if completion_id.startswith(COMPLETION_ID_PREFIX) else None
    if meta is None or meta.tenant != tenant:
        raise NotFound(f"No resumable stream with id '{completion_id}' found.", param="completion_id")
    if meta.traceparent is not None:  # the resume's trace points at the request that started the stream
        link_current_span(meta.traceparent, why="stream start")
    after = _starting_after(starting_after, last_event_id)
    last = await chunk_log.last(job_id)
    if last is None and time.time() > meta.deadline + FINAL_GRACE_S:
        raise NotFound(f"The stream '{completion_id}' is no longer kept.", param="completion_id")
    end = -1 if last is None else last.seq
    if last is not None and _ends_in_error(last):
        end -= 1  # the error event has no id
    elif last is not None and last.is_final and meta.include_usage and last.usage is not None:
        end += 1  # the usage event's id
    if after > end:
        raise InvalidRequest(
            f"Event {after} is past the end of the stream '{completion_id}' (its last event so far is {end}).",
            param="starting_after" if starting_after is not None else "Last-Event-ID",
        )
    builder = ResponseBuilder(
        kind="chat",
        job_id=job_id,
        model=meta.model,
        include_usage=meta.include_usage,
        logprobs=meta.logprobs,
        created=meta.created,
    )
    if last is not None and last.is_final and after >= last.seq:
        return _tail(builder, last if after == last.seq else None)
    return _events(chunk_log, builder, job_id, after, meta)


async def _tail(builder: ResponseBuilder, final: TokenChunk | None) -> AsyncIterator[bytes]:
    """The end of a stream the client has every chunk event of: the usage event if it missed it
    (`final`: the final chunk, whose usage it is), then `[DONE]`."""
    events = []
    if final is not None and builder.include_usage and final.usage is not None:
        events.append(sse_event(final.seq + 1, builder.usage_chunk(final.usage)))
    yield b"".join([*events, SSE_END])


async def _events(
    chunk_log: ChunkLog, builder: ResponseBuilder, job_id: str, after: int, meta: StreamMeta
) -> AsyncIterator[bytes]:
    """The events of the chunks after `after`, a page of the log at a time, live once the log is
    read, up to the final chunk's (then the usage event and `[DONE]`). A job that logs nothing
    until past its deadline, or a log Redis fails to give, ends the stream with a
    `stream_interrupted` error."""
    idle_timeout_s = max(0.0, meta.deadline - time.time()) + FINAL_GRACE_S
    try:
        async for page in chunk_log.pages(job_id, after, idle_timeout_s=idle_timeout_s):
            events = []
            for chunk in page:
                if _ends_in_error(chunk):
                    error = chunk_error(chunk) if chunk.finish_reason == "error" else _interrupted()
                    events += [_error_event(error), SSE_END]
                    break
                first = chunk.seq == 0
                if has_event(chunk, first):
                    events.append(sse_event(chunk.seq, builder.chunk(0, chunk, first=first)))
                if chunk.finish_reason is not None:
                    if builder.include_usage and chunk.usage is not None:
                        events.append(sse_event(chunk.seq + 1, builder.usage_chunk(chunk.usage)))
                    events.append(SSE_END)
            yield b"".join(events)
    except TimeoutError:
        yield _error_event(_interrupted()) + SSE_END
    except RedisError as exc:  # the head went out: the client learns it from an event, and resumes
        log.warning("chunk_log_read_failed", error=repr(exc))
        yield _error_event(_interrupted()) + SSE_END


def _ends_in_error(chunk: TokenChunk) -> bool:
    """Whether a chunk ends its stream with an error event (which has no id) instead of its own:
    a worker's error, or a cancel. A chat job is cancelled only by its session manager, when the
    answer could not go on (its deadline passed, its relay lost the stream or stopped), so it ends
    as that stream did, not as an answer that stopped."""
    return chunk.finish_reason in ("error", "cancelled")


def _interrupted() -> UpstreamError:
    return UpstreamError("The answer's stream ended before its last chunk.", code="stream_interrupted")


def _error_event(error: AxonError) -> bytes:
    """An error as the stream's relay sends it: an event without an id."""
    return b"data: " + orjson.dumps(error.body()) + b"\n\n"
