"""Server-sent events as the session manager frames them: the head and keep-alive comments of an
event stream, the events of a chat stream (each with its SSE `id:`, `chat/protocol.py` says which),
and the end of a stream that failed after its head went out."""

from typing import Any

import orjson
from starlette.types import Send

from shared.errors import AxonError
from shared.http_responses import SSE_END

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
# An SSE comment: clients ignore it, proxies see the connection is not idle.
SSE_KEEPALIVE = b": keep-alive\n\n"


class StreamKeepAlive:
    """Keeps a stream's connection busy while its request waits for a worker of its model to start
    (`CompletionService.first_chunk`'s `on_wait`): the first beat sends the head (200: any later
    failure is an error event), each beat an SSE comment (or `beat`: Anthropic's streams send a
    `ping` event)."""

    __slots__ = ("_beat", "_headers", "_send", "started")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]], *, beat: bytes = SSE_KEEPALIVE) -> None:
        self._send = send
        self._headers = headers
        self._beat = beat
        self.started = False

    async def beat(self) -> None:
        if not self.started:
            await self._send({"type": "http.response.start", "status": 200, "headers": self._headers})
            self.started = True
        await self._send({"type": "http.response.body", "body": self._beat, "more_body": True})


# The usage event's id in a stream of several choices.
USAGE_EVENT_ID = b"usage"


# The heads of the events of seqs 0..4095 (about 230 kB): every chunk of a chat stream takes
# `sse_event`, and its id from here costs nothing measurable, formatted about 60 ns (a tenth of
# the event's bytes besides its JSON).
_EVENT_HEADS = tuple(b"id: %d\ndata: " % seq for seq in range(4096))


def sse_event(seq: int, payload: dict[str, Any]) -> bytes:
    """One server-sent event whose id is a number (a stream of one choice)."""
    head = _EVENT_HEADS[seq] if seq < len(_EVENT_HEADS) else b"id: %d\ndata: " % seq
    return head + orjson.dumps(payload) + b"\n\n"


def sse_named_event(event_id: bytes, payload: dict[str, Any]) -> bytes:
    """One server-sent event with its id."""
    return b"id: %b\ndata: %b\n\n" % (event_id, orjson.dumps(payload))


def sse_error(exc: AxonError) -> bytes:
    """The end of a stream whose head has gone out: the error as an event, then `[DONE]`."""
    return b"data: " + orjson.dumps(exc.body()) + b"\n\n" + SSE_END
