"""uvicorn's HTTP protocol with the limits a server facing the internet needs.

uvicorn (httptools) waits forever for a request head that never completes (a connection that
sends nothing, or half its headers: slowloris), accepts headers of any size, and keeps writing
into the buffers of a client that stopped reading. The gateway is the public door, so it runs
uvicorn with this protocol class (`uvicorn.run(..., http=guarded_protocol(limits))`), which adds:

- a request head must arrive whole within `head_timeout_s` of the connection opening, or of the
  previous response on a keep-alive connection; otherwise the connection is closed (with 408 if
  part of a head came);
- a request head larger than `max_head_bytes` is answered 431 at once and the connection closed;
- a client that reads nothing for `stall_timeout_s` while its response waits to be written (the
  transport's buffer is full) is disconnected, which the app sees as an ordinary disconnect;
- the kernel's send buffer of each connection is `send_buffer_bytes`, so a slow client holds a
  bounded amount of memory.

Errors are in OpenAI's shape, like every other error of the API.
"""

import asyncio
import socket
import struct
from dataclasses import dataclass
from typing import ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shared.errors import error_body
from shared.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    head_timeout_s: float
    max_head_bytes: int
    stall_timeout_s: float
    send_buffer_bytes: int


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = orjson.dumps(error_body(message, error_type="invalid_request_error", code=code))
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        status,
        reason.encode(),
        len(body),
        body,
    )


_TIMED_OUT = _refusal(408, "Request Timeout", "The request head did not arrive in time.", "request_timeout")
_HEAD_TOO_LARGE = _refusal(
    431, "Request Header Fields Too Large", "The request's headers are too large.", "request_header_too_large"
)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `limits` applied to every connection (set by `guarded_protocol`)."""

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._awaiting_head = False
        self._head_bytes = 0
        self._parsed_head_bytes = 0
        self._head_too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
        self._expect_head()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # A head still incomplete but already too large (it arrives in pieces).
        if self._awaiting_head and self._head_bytes > self.limits.max_head_bytes and not self.transport.is_closing():
            self._refuse(_HEAD_TOO_LARGE, "request_head_too_large")

    # A head that arrived whole is measured as it is parsed: its URL and headers.
    def on_url(self, url: bytes) -> None:
        self._check_head_size(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._check_head_size(len(name) + len(value) + 4)
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._refuse(_HEAD_TOO_LARGE, "request_head_too_large")
        else:
            super().send_400_response(msg)

    def _check_head_size(self, size: int) -> None:
        self._parsed_head_bytes += size
        if self._parsed_head_bytes > self.limits.max_head_bytes:
            self._head_too_large = True
            # httptools stops parsing; uvicorn answers 400, which send_400_response makes 431.
            raise ValueError("request head too large")

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._cancel(self._head_timer)
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._expect_head()  # the next request on this keep-alive connection

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(self._stall_timer)
        self._stall_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel(self._head_timer)
        self._cancel(self._stall_timer)
        super().connection_lost(exc)

    def _expect_head(self) -> None:
        self._awaiting_head = True
        self._head_bytes = 0
        self._parsed_head_bytes = 0
        self._cancel(self._head_timer)
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        if not self._awaiting_head or self.transport.is_closing():
            return
        if self._head_bytes:
            self._refuse(_TIMED_OUT, "request_head_timeout")
        else:
            self.transport.close()  # an idle connection: nothing to answer

    def _stalled(self) -> None:
        self._stall_timer = None
        if self.transport.is_closing():
            return
        log.warning("client_stalled", timeout_s=self.limits.stall_timeout_s)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # Linger 0: a reset now, and the unsent answer freed, rather than an orphaned socket
            # the kernel keeps trying to deliver to a client that does not read.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _refuse(self, response: bytes, event: str) -> None:
        self._awaiting_head = False
        log.warning(event)
        self.transport.write(response)
        self.transport.close()

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
    """uvicorn's httptools protocol class with `limits` applied to every connection."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})
