"""A lean plain-HTTP/1.1 keep-alive client that POSTs to one URL, for `axon bench`.

httpx's default transport (httpcore + h11 + anyio) spends about 50 µs of pure Python per network
read and scans its whole pool on every request, and httpx builds URL, header and request objects
per call (another ~100 µs): at tens of thousands of server-sent events per second on a 2-core
machine the measuring client, not the server, would be the bottleneck. This client writes
pre-built request heads on an `asyncio.Protocol` and parses responses with httptools' C parser
(llhttp, as uvicorn does). A streamed body can go straight from the socket callback to a `sink`
together with its arrival time, so there is no task switch per event.

Only `http://` is supported; `Http1Pool.supports` says whether a URL can use it (the caller falls
back to httpx otherwise).
"""

import asyncio
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

try:
    import httptools
except ImportError:  # an optional speed-up: callers fall back to httpx without it
    httptools = None

BodySink = Callable[[bytes, float], None]
"""Receives body bytes and their arrival time (`time.perf_counter()`)."""

# Stop reading from the socket while this much body is waiting for the reader.
_PAUSE_READING_BYTES = 1 << 20


class ConnectError(OSError):
    """The connection could not be opened."""


class RemoteProtocolError(Exception):
    """The server broke HTTP: closed mid-response or sent something unparsable."""


class _Connection(asyncio.Protocol):
    """One TCP connection carrying one exchange at a time; fed by httptools' callbacks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser: object | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._arrival_s = 0.0
        self._sink: BodySink | None = None
        self._diverted: BodySink | None = None
        self._framed = False  # Content-Length or chunked: the body does not end at close
        self._headers_seen = False
        self._done: asyncio.Future[None] | None = None
        self.received_any = False
        self.status_code = 0
        self.keep_alive = False
        self.closed = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self._done is None or self._done.done():
            self._fail(RemoteProtocolError("the server sent data with no request outstanding"))
            return
        self._arrival_s = time.perf_counter()
        self.received_any = True
        try:
            self._parser.feed_data(data)  # type: ignore[attr-defined]
        except httptools.HttpParserError as exc:
            self._fail(RemoteProtocolError(f"invalid HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is None or self._done.done():
            return
        if self._headers_seen and not self._framed:
            self.on_message_complete()  # an unframed body ends when the server closes
            return
        self._fail(RemoteProtocolError("the server closed the connection before the response ended"))

    def pause_writing(self) -> None:  # request bodies are small; the transport buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status_code = self._parser.get_status_code()  # type: ignore[attr-defined]
        self.keep_alive = self._parser.should_keep_alive()  # type: ignore[attr-defined]
        self._headers_seen = True
        if self.status_code == 200:
            self._diverted = self._sink

    def on_body(self, body: bytes) -> None:
        if self._diverted is not None:
            self._diverted(body, self._arrival_s)
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_READING_BYTES and not self._paused and self._transport is not None:
            self._transport.pause_reading()  # nobody drains this until the end: bound the memory
            self._paused = True

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    # -- one exchange ------------------------------------------------------------------------

    async def exchange(self, request: bytes, *, sink: BodySink | None) -> tuple[int, bytes]:
        """Write one request; return the status and the body (empty when it went to `sink`)."""
        assert self._transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._chunks, self._buffered, self._framed = [], 0, False
        self._sink, self._diverted, self.received_any, self._headers_seen = sink, None, False, False
        self._done = self._loop.create_future()
        self._transport.write(request)
        await self._done
        if self._paused:
            self._transport.resume_reading()
            self._paused = False
        body = b"".join(self._chunks)
        self._chunks = []
        return self.status_code, body

    @property
    def reusable(self) -> bool:
        return self.keep_alive and not self.closed and self._done is not None and self._done.done()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def _fail(self, error: Exception) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self.close()


class Http1Pool:
    """POSTs to one `http://` URL over keep-alive connections, as many at once as the caller runs.

    The caller bounds how many posts run at once and how long each may take (a cancelled post
    closes its connection).
    """

    def __init__(
        self, url: str, *, headers: Mapping[str, str], max_idle_connections: int | None, connect_timeout_s: float
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"Http1Pool speaks plain http only: {url}")
        self._host = parts.hostname
        self._port = parts.port or 80
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: keep-alive"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self._head = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self._idle: list[_Connection] = []
        self._max_idle = max_idle_connections
        self._connect_timeout_s = connect_timeout_s

    @staticmethod
    def supports(url: str) -> bool:
        return httptools is not None and url.startswith("http://")

    async def post(self, body: bytes, *, sink: BodySink | None = None) -> tuple[int, bytes]:
        """POST `body`; return the status and the response body.

        With `sink`, a 200 response's body goes to `sink` as it arrives and the returned body is
        empty. A reused keep-alive connection that the server closed before answering (its idle
        timeout) is retried once on a new connection.

        Raises:
            ConnectError: the connection could not be opened.
            RemoteProtocolError: the server closed mid-response or sent invalid HTTP.
        """
        request = self._head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        connection = self._take_idle()
        if connection is not None:
            try:
                return await self._exchange(connection, request, sink)
            except RemoteProtocolError:
                if connection.received_any:
                    raise
        return await self._exchange(await self._connect(), request, sink)

    async def aclose(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()

    async def _exchange(self, connection: _Connection, request: bytes, sink: BodySink | None) -> tuple[int, bytes]:
        try:
            result = await connection.exchange(request, sink=sink)
        except BaseException:  # failed or cancelled mid-response: never reuse it
            connection.close()
            raise
        if connection.reusable and (self._max_idle is None or len(self._idle) < self._max_idle):
            self._idle.append(connection)
        else:
            connection.close()
        return result

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(loop), self._host, self._port)
        except TimeoutError:
            raise ConnectError(f"connecting to {self._host}:{self._port} timed out") from None
        except OSError as exc:
            raise ConnectError(f"{exc.strerror or exc} ({self._host}:{self._port})") from None
        return connection
