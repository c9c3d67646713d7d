"""A lean plain-HTTP/1.1 keep-alive client for one host: the gateway's hop to the session manager
and the load generator of `axon bench`.

General clients spend far more than the request itself on a short hop: with 100 requests in
flight (`benchmarks/micro/http1.py`, figures in benchmarks/RESULTS.md) this client costs 19 µs of
CPU per request with a small JSON answer, aiohttp 3.5-3.8 times that and httpx about 1.1 ms (most
of it httpcore's pool going over every connection on each request); on a stream of 8 events,
40-42 µs against aiohttp's 98-101 µs.
This client writes the request head on an `asyncio.Protocol` and parses responses with httptools'
C parser (llhttp, as uvicorn does). Response bytes are handed over from the socket callback: to a
`sink` with their arrival time (the bench's clock), or into a buffer that `Response.pieces()`
drains, everything that arrived since its last wake-up joined into one piece.

Only `http://` is supported (`Http1Client.supports` says whether a URL can use it).
"""

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from urllib.parse import urlsplit

try:
    import httptools
except ImportError:  # an optional speed-up for the bench, which falls back to httpx without it
    _HAVE_HTTPTOOLS = False
else:
    _HAVE_HTTPTOOLS = True

BodySink = Callable[[bytes, float], None]
"""Receives body bytes and their arrival time (`time.perf_counter()`)."""

# Stop reading from the socket while this much body waits for its reader (bounded memory).
_PAUSE_READING_BYTES = 1 << 20


class ConnectError(OSError):
    """The connection could not be opened."""


class RemoteProtocolError(Exception):
    """The server broke HTTP: closed mid-response or sent something unparsable."""


class ReadTimeout(TimeoutError):
    """The server sent nothing for longer than the read timeout."""


class Response:
    """A response whose head has arrived; its body arrives through `read()` or `pieces()`.

    The connection goes back to the pool once the body has been read to its end; `close()`
    abandons a response half-read (its connection is closed, never reused).
    """

    def __init__(self, connection: "_Connection", client: "Http1Client") -> None:
        self._connection = connection
        self._client = client
        self.status: int = connection.status_code
        self.headers: list[tuple[bytes, bytes]] = connection.headers
        self._finished = False

    def header(self, name: bytes) -> bytes | None:
        """The first header called `name` (lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.pieces()])

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each piece is everything received since the previous one.

        Raises:
            ReadTimeout: nothing arrived for the client's read timeout.
            RemoteProtocolError: the server closed mid-body or broke HTTP.
        """
        connection = self._connection
        try:
            while True:
                piece = connection.take_body()
                if piece:
                    yield piece
                    continue
                if connection.complete:
                    break
                await connection.wait(self._client.read_timeout_s)
        except BaseException:
            self.close()
            raise
        self._finish()

    def close(self) -> None:
        """Abandon the response: its connection is closed."""
        if not self._finished:
            self._finished = True
            self._connection.close()

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._client._release(self._connection)


class _Connection(asyncio.Protocol):
    """One TCP connection carrying one exchange at a time; fed by httptools' callbacks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._arrival_s = 0.0
        self._sink: BodySink | None = None
        self._diverted: BodySink | None = None
        self._framed = False  # Content-Length or chunked: the body does not end at close
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        # The read timeout of `wait`: when the current wait gives up, and the one timer that
        # checks it (armed by a wait, moved on at its firing while later waits go on).
        self._read_deadline = 0.0
        self._read_timer: asyncio.TimerHandle | None = None
        self._error: Exception | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.received_any = False
        self.complete = False
        self.status_code = 0
        self.keep_alive = False
        self.closed = False
        # Cleared while the transport's write buffer is full (`pause_writing`): a streamed body waits.
        self._writable = asyncio.Event()
        self._writable.set()

    # -- asyncio.Protocol --------------------------------------------------------------------

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # typeshed: BaseTransport; a TCP stream's is a Transport

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self.complete:
            self._fail(RemoteProtocolError("the server sent data with no request outstanding"))
            return
        self._arrival_s = time.perf_counter()
        self.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(RemoteProtocolError(f"invalid HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._writable.set()  # a writer waiting for room learns the connection is gone
        if self._parser is None or self.complete:
            return
        if self._head is not None and self._head.done() and not self._framed:
            self.on_message_complete()  # an unframed body ends when the server closes
            return
        self._fail(RemoteProtocolError("the server closed the connection before the response ended"))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True
        self.headers.append((lowered, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # called back from inside parser.feed_data()
        self.status_code = parser.get_status_code()
        self.keep_alive = parser.should_keep_alive()
        if self.status_code == 200:
            self._diverted = self._sink
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._diverted is not None:
            self._diverted(body, self._arrival_s)
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_READING_BYTES and not self._paused and self._transport is not None:
            self._transport.pause_reading()
            self._paused = True
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- one exchange ------------------------------------------------------------------------

    def begin(self, request: bytes, sink: BodySink | None) -> asyncio.Future[None]:
        """Write one request; the returned future resolves once the response head is in."""
        assert self._transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._body, self._buffered, self._framed, self.headers = [], 0, False, []
        self._sink, self._diverted, self.received_any, self.complete = sink, None, False, False
        self._error = None
        self._head = self._loop.create_future()
        self._transport.write(request)
        return self._head

    async def write(self, data: bytes, timeout_s: float | None) -> None:
        """Write part of a streamed request body, waiting while the server is not reading.

        Raises:
            RemoteProtocolError: the connection is closed.
            ReadTimeout: the server took nothing for `timeout_s`.
        """
        if self.closed or self._transport is None:
            raise RemoteProtocolError("the server closed the connection while the request was sent")
        self._transport.write(data)
        try:
            async with asyncio.timeout(timeout_s):
                await self._writable.wait()
        except TimeoutError:
            raise ReadTimeout(f"the server took nothing of the request for {timeout_s} s") from None
        if self.closed:
            raise RemoteProtocolError("the server closed the connection while the request was sent")

    def take_body(self) -> bytes:
        """Everything buffered so far (raising the exchange's error, if any, once drained)."""
        if self._body:
            body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            self._body, self._buffered = [], 0
            if self._paused and self._transport is not None:
                self._transport.resume_reading()
                self._paused = False
            return body
        if self._error is not None:
            raise self._error
        return b""

    async def wait(self, timeout_s: float | None) -> None:
        """Until more body (or the end, or an error) arrives.

        A streamed body waits once for nearly every piece: a wait arms no timer of its own; one
        timer checks at the deadline whether a wait is still on (`_check_read_deadline`).

        Raises:
            ReadTimeout: nothing arrived for `timeout_s`.
        """
        loop = self._loop
        if timeout_s is not None:
            deadline = loop.time() + timeout_s
            self._read_deadline = deadline
            timer = self._read_timer
            if timer is None or timer.when() > deadline:
                if timer is not None:
                    timer.cancel()
                self._read_timer = loop.call_at(deadline, self._check_read_deadline, timeout_s)
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _check_read_deadline(self, timeout_s: float) -> None:
        self._read_timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # the next wait arms it again
        if self._loop.time() >= self._read_deadline:
            waiter.set_exception(ReadTimeout(f"no data for {timeout_s} s"))
        else:
            self._read_timer = self._loop.call_at(self._read_deadline, self._check_read_deadline, timeout_s)

    @property
    def reusable(self) -> bool:
        return self.keep_alive and not self.closed and self.complete and self._error is None

    def close(self) -> None:
        self.closed = True
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self._transport is not None:
            self._transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()
        self.close()


class Http1Client:
    """Requests to one `http://` host over keep-alive connections.

    `read_timeout_s` bounds every wait for the response head or more of its body; an idle
    connection older than `idle_timeout_s` is closed rather than reused (keep it below the
    server's keep-alive timeout). It opens as many connections as there are requests in flight:
    bounding those is the caller's job (the gateway refuses past `AXON_MAX_REQUESTS_IN_FLIGHT`).
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_idle_connections: int | None,
        connect_timeout_s: float,
        read_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"Http1Client speaks plain http only: {base_url}")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._host_line = f"Host: {parts.netloc}\r\n".encode("latin-1")
        self.base_path = parts.path.rstrip("/")
        self._idle: list[tuple[_Connection, float]] = []
        # Every connection opened and not yet collected, idle or carrying a response (`abort`).
        self._opened: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self._max_idle = max_idle_connections
        self._idle_timeout_s = idle_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s

    @staticmethod
    def supports(url: str) -> bool:
        return _HAVE_HTTPTOOLS and url.startswith("http://")

    def head(self, method: str, target: str, headers: Iterable[tuple[str, str]]) -> bytes:
        """A request head (without Content-Length and the blank line), to render once and reuse."""
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers)
        return (
            f"{method} {self.base_path}{target} HTTP/1.1\r\n".encode("latin-1")
            + self._host_line
            + lines.encode("latin-1")
        )

    async def request(
        self,
        method: str,
        target: str,
        *,
        headers: Iterable[tuple[str, str]] | Mapping[str, str] = (),
        body: bytes | None = None,
        sink: BodySink | None = None,
    ) -> Response:
        """Send a request; return once the response head has arrived.

        `target` is the path and query, already escaped. See `send` for `sink` and the errors.
        """
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        return await self.send(self.head(method, target, pairs), body, sink=sink)

    async def send(self, head: bytes, body: bytes | None, *, sink: BodySink | None = None) -> Response:
        """Send a pre-rendered `head` (see `head()`) and `body`; return once the response head is in.

        With `sink`, a 200 response's body goes to `sink` as it arrives instead of `pieces()`. A
        reused keep-alive connection that the server closed before answering (its idle timeout)
        is retried once on a new connection.

        Raises:
            ConnectError: the connection could not be opened.
            ReadTimeout: no response head within the read timeout.
            RemoteProtocolError: the server closed early or sent invalid HTTP.
        """
        request = head + (b"Content-Length: %d\r\n\r\n" % len(body) + body if body is not None else b"\r\n")
        connection = self._take_idle()
        if connection is not None:
            try:
                return await self._exchange(connection, request, sink)
            except RemoteProtocolError:
                if connection.received_any:
                    raise
        return await self._exchange(await self._connect(), request, sink)

    async def stream(
        self, method: str, target: str, *, headers: Iterable[tuple[str, str]], body: AsyncIterator[bytes]
    ) -> Response:
        """Send a request whose body is `body`'s pieces as they come (chunked), on a connection of
        its own (a body read once cannot be retried); return once the response head has arrived.
        A server that answers before the whole body is sent gets no more of it (the connection is
        then closed after the response).

        Raises:
            ConnectError, ReadTimeout, RemoteProtocolError: as `send`'s (ReadTimeout also when
                the server takes nothing of the body for the read timeout).
            Whatever `body` raises (the connection is closed).
        """
        head = self.head(method, target, headers) + b"Transfer-Encoding: chunked\r\n\r\n"
        connection = await self._connect()
        answered = connection.begin(head, None)
        try:
            await self._send_pieces(connection, answered, body)
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    await answered
            except TimeoutError:
                raise ReadTimeout(f"no response within {self.read_timeout_s} s") from None
        except BaseException:
            if not answered.done():
                answered.cancel()  # nobody waits for this answer any more
            elif not answered.cancelled():
                answered.exception()  # retrieved: the error raised here says what happened
            connection.close()
            raise
        return Response(connection, self)

    async def _send_pieces(
        self, connection: _Connection, answered: asyncio.Future[None], body: AsyncIterator[bytes]
    ) -> None:
        """`body` in chunks, until its end or the server's answer (then the connection is not reused)."""
        try:
            async for piece in body:
                if answered.done():
                    break
                if piece:  # an empty chunk would end the body
                    await connection.write(b"%x\r\n%s\r\n" % (len(piece), piece), self.read_timeout_s)
            else:
                await connection.write(b"0\r\n\r\n", self.read_timeout_s)
                return
        except RemoteProtocolError:
            # Closed after an answer that came early (a refusal): that answer is the response.
            if not answered.done() or answered.exception() is not None:
                raise
        connection.keep_alive = False

    async def aclose(self) -> None:
        for connection, _ in self._idle:
            connection.close()
        self._idle.clear()

    def abort(self) -> None:
        """Close every connection, those in the middle of a response too: their readers get
        `RemoteProtocolError` at once (a stopping process ends what it still relays)."""
        for connection in list(self._opened):
            connection.close()
        self._idle.clear()

    async def _exchange(self, connection: _Connection, request: bytes, sink: BodySink | None) -> Response:
        head = connection.begin(request, sink)
        try:
            async with asyncio.timeout(self.read_timeout_s):
                await head
        except TimeoutError:
            connection.close()
            raise ReadTimeout(f"no response within {self.read_timeout_s} s") from None
        except BaseException:  # failed or cancelled before the head: never reuse it
            connection.close()
            raise
        return Response(connection, self)

    def _release(self, connection: _Connection) -> None:
        """The response was read to its end: keep the connection for the next request."""
        if connection.reusable and (self._max_idle is None or len(self._idle) < self._max_idle):
            self._idle.append((connection, time.monotonic()))
        else:
            connection.close()

    def _take_idle(self) -> _Connection | None:
        oldest_s = time.monotonic() - self._idle_timeout_s if self._idle_timeout_s is not None else None
        while self._idle:
            connection, idle_since = self._idle.pop()
            if connection.closed:
                continue
            if oldest_s is not None and idle_since < oldest_s:
                connection.close()  # the server may be closing it right now
                continue
            return connection
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(loop), self._host, self._port)
            self._opened.add(connection)
        except TimeoutError:
            raise ConnectError(f"connecting to {self._host}:{self._port} timed out") from None
        except OSError as exc:
            raise ConnectError(f"{exc.strerror or exc} ({self._host}:{self._port})") from None
        return connection


class Http1Pool:
    """POSTs to one `http://` URL with fixed headers (the bench's client): the head is rendered
    once, and each post returns the status and the body (empty when it went to `sink`)."""

    def __init__(
        self, url: str, *, headers: Mapping[str, str], max_idle_connections: int | None, connect_timeout_s: float
    ) -> None:
        parts = urlsplit(url)
        self._client = Http1Client(
            f"{parts.scheme}://{parts.netloc}",
            max_idle_connections=max_idle_connections,
            connect_timeout_s=connect_timeout_s,
        )
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._head = self._client.head("POST", target, [("Connection", "keep-alive"), *headers.items()])

    @staticmethod
    def supports(url: str) -> bool:
        return Http1Client.supports(url)

    async def post(self, body: bytes, *, sink: BodySink | None = None) -> tuple[int, bytes]:
        """POST `body`; return the status and the response body (see `Http1Client.send`)."""
        response = await self._client.send(self._head, body, sink=sink)
        return response.status, await response.read()

    async def aclose(self) -> None:
        await self._client.aclose()
