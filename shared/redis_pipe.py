"""Redis connections of the hot path: commands pipelined automatically across concurrent
requests (`RedisPipe`), and pub/sub subscriptions batched the same way (`RedisSubscriber`).

Every command issued during one event-loop iteration goes out in one socket write on one
connection, and replies are parsed by hiredis in the protocol callback and handed to their
callers in order. On a request's path (a rate-limit check, a chunk's publish script, a
usage record) this costs about a ninth of a redis-py command's client CPU (6.6 µs against
56-63 µs with 100 commands in flight: `benchmarks/micro/redis_pipe.py`, figures in
benchmarks/RESULTS.md), where redis-py checks a connection out of a pool, wraps it in timeouts
and retries and parses the reply in a coroutine of its own; and under load a hundred commands
share one write instead of a hundred.

`RedisPipe` failure semantics: a command is never retried (most of these are not idempotent). If the
connection drops, every command in flight fails with `redis.exceptions.ConnectionError`;
if the oldest command in flight gets no reply within `timeout_s`, the connection is dropped
and they fail with `redis.exceptions.TimeoutError`. Either way a command may or may not have
run. A command that was never written, because no connection could be opened, fails with
`NotSent` (a `ConnectionError`): it did not run, and its caller may send it again. The next
command reconnects.
"""

import asyncio
import hashlib
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import hiredis
from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = bytes | str | int | float


class NotSent(RedisConnectionError):
    """The command was never written to Redis (no connection could be opened): it did not run."""


_ProtocolT = TypeVar("_ProtocolT", bound=asyncio.Protocol)


def pack(args: tuple[Arg, ...]) -> bytes:
    """One command in the Redis protocol (RESP2): hiredis's encoder in C (2.5 times as fast as
    `_pack`, 2 µs less per worker chunk), or `_pack` for what it refuses (a bool)."""
    try:
        return hiredis.pack_command(args)  # type: ignore[arg-type,no-any-return]  # its stub: a 1-tuple
    except TypeError:
        return _pack(args)


def _pack(args: tuple[Arg, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif not isinstance(arg, bytes):
            arg = repr(arg).encode() if isinstance(arg, float) else b"%d" % arg
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


class PipeScript:
    """A Lua script called by its SHA-1 (`EVALSHA`), loaded on first use and after a Redis restart."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


# A command queued: its bytes, its reply's future, and the script it calls (None: not a script).
_Command = tuple[bytes, "asyncio.Future[Any]", PipeScript | None]


class _Protocol(asyncio.Protocol):
    def __init__(self, pipe: "RedisPipe") -> None:
        self._pipe = pipe
        self._reader = hiredis.Reader(replyError=ResponseError)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            self._pipe._reply(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._pipe._lost(self, exc)


class Endpoint:
    """Where and how to connect: host and port, TLS (`rediss://`), and the commands each new
    connection starts with (`AUTH`, `SELECT`)."""

    def __init__(self, url: str) -> None:
        options = parse_url(url)
        self.host = options.get("host", "127.0.0.1")
        self.port = int(options.get("port", 6379))
        self.ssl = _ssl_context(options) if "connection_class" in options else None
        self.setup: list[tuple[Arg, ...]] = []
        if options.get("password"):
            self.setup.append(("AUTH", *filter(None, [options.get("username"), options["password"]])))
        if options.get("db"):
            self.setup.append(("SELECT", options["db"]))

    async def connect(
        self, protocol_factory: Callable[[], _ProtocolT], timeout_s: float
    ) -> tuple[asyncio.Transport, _ProtocolT]:
        """Open a connection.

        Raises:
            redis.exceptions.ConnectionError: refused, unreachable or too slow.
        """
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                return await loop.create_connection(protocol_factory, self.host, self.port, ssl=self.ssl)
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"Error connecting to {self.host}:{self.port}: {exc!r}") from None


class RedisPipe:
    """One auto-pipelined connection to Redis (`redis://` or `rediss://` URL, with db and auth)."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        self._endpoint = Endpoint(url)
        self._host, self._port, self._setup = self._endpoint.host, self._endpoint.port, self._endpoint.setup
        self._timeout_s = timeout_s
        self._transport: asyncio.Transport | None = None
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._queued: list[_Command] = []
        self._in_flight: deque[tuple[asyncio.Future[Any], float, bytes, PipeScript | None]] = deque()
        self._flush_scheduled = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._setup_futures: set[asyncio.Future[Any]] = set()
        self._closed = False

    async def execute(self, *args: Arg) -> Any:
        """Run one command; returns its reply (bytes, int, list, None).

        Raises:
            ResponseError: Redis answered with an error.
            ConnectionError, TimeoutError (redis.exceptions): no reply; the command may or may
                not have run.
        """
        return await self.submit(*args)

    def submit(self, *args: Arg) -> asyncio.Future[Any]:
        """Queue one command and return the future of its reply, without waiting (a caller can
        issue several, e.g. a write whose reply it does not need, and await them together)."""
        return self._enqueue(pack(args), None)

    async def evalsha(self, script: PipeScript, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run `script`; if Redis does not have it (first use, or Redis restarted), load it and retry."""
        return await self.submit_script(script, keys, args)

    def submit_script(self, script: PipeScript, keys: Sequence[Arg], args: Sequence[Arg]) -> asyncio.Future[Any]:
        """`evalsha` without waiting: the future of the script's reply (see `submit`). A `NOSCRIPT`
        reply is not the caller's: the script is loaded and the call sent again, for the same future
        (`_reply`)."""
        return self._enqueue(pack(("EVALSHA", script.sha, len(keys), *keys, *args)), script)

    def _enqueue(self, packed: bytes, script: PipeScript | None) -> asyncio.Future[Any]:
        if self._closed:
            raise RedisConnectionError("The Redis pipe is closed.")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queued.append((packed, future, script))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return future

    async def aclose(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._transport is not None:
            self._transport.close()
        self._fail_all(RedisConnectionError("The Redis pipe was closed."))

    # -- sending ------------------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._queued:
            return
        if self._transport is None or self._transport.is_closing():
            if self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(self._connect())
            return  # sent once connected
        batch, self._queued = self._queued, []
        sent_at = time.monotonic()
        self._transport.write(b"".join(packed for packed, _, _ in batch))
        self._in_flight.extend((future, sent_at, packed, script) for packed, future, script in batch)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(self._timeout_s, self._check_overdue)

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await self._endpoint.connect(lambda: _Protocol(self), self._timeout_s)
        except RedisConnectionError as exc:
            self._connecting = None
            self._fail_queued(exc)
            return
        self._transport, self._protocol, self._connecting = transport, protocol, None
        setup: list[_Command] = [(pack(command), loop.create_future(), None) for command in self._setup]
        self._setup_futures = {future for _, future, _ in setup}
        self._queued[:0] = setup  # before anything else on this connection
        self._flush()

    # -- receiving ----------------------------------------------------------------------------

    def _reply(self, reply: Any) -> None:
        if not self._in_flight:
            return  # a reply nobody waits for (its command timed out): the connection is gone anyway
        future, _, packed, script = self._in_flight.popleft()
        if self._setup_futures and future in self._setup_futures:
            self._setup_futures.discard(future)
            if isinstance(reply, ResponseError):
                self._setup_refused(reply)
            return
        if isinstance(reply, ResponseError):
            if script is not None and str(reply).startswith("NOSCRIPT"):
                # Both in one write: the load runs first, so the retry (once) finds the script.
                self.submit("SCRIPT", "LOAD", script.source).add_done_callback(_ignore)
                self._queued.append((packed, future, None))
                return
            if not future.done():
                future.set_exception(reply)
            return
        if not future.done():
            future.set_result(reply)

    def _setup_refused(self, reply: ResponseError) -> None:
        """AUTH or SELECT refused: nothing on this connection can succeed."""
        transport, self._transport, self._protocol = self._transport, None, None
        self._fail_all(RedisConnectionError(f"Redis refused the connection's setup: {reply}"))
        if transport is not None:
            transport.abort()

    def _lost(self, protocol: _Protocol, exc: Exception | None) -> None:
        if protocol is not self._protocol:
            return
        self._transport = self._protocol = None
        self._fail_in_flight(RedisConnectionError(f"Connection to {self._host}:{self._port} lost: {exc!r}"))
        if self._queued and not self._closed:
            self._flush()  # reconnect for the commands that were waiting

    def _check_overdue(self) -> None:
        self._watchdog = None
        if not self._in_flight:
            return
        age_s = time.monotonic() - self._in_flight[0][1]
        if age_s >= self._timeout_s:
            transport, self._transport, self._protocol = self._transport, None, None
            self._fail_in_flight(RedisTimeoutError(f"No reply from {self._host}:{self._port} in {self._timeout_s} s."))
            if transport is not None:
                transport.abort()
            if self._queued:
                self._flush()
            return
        self._watchdog = asyncio.get_running_loop().call_later(self._timeout_s - age_s, self._check_overdue)

    # -- failing ------------------------------------------------------------------------------

    def _fail_in_flight(self, error: Exception) -> None:
        in_flight, self._in_flight = self._in_flight, deque()
        for future, *_ in in_flight:
            if not future.done():
                future.set_exception(error)

    def _fail_queued(self, error: Exception) -> None:
        queued, self._queued = self._queued, []
        error = error if isinstance(error, NotSent) else NotSent(str(error))
        for _, future, _ in queued:
            if not future.done():
                future.set_exception(error)

    def _fail_all(self, error: Exception) -> None:
        self._fail_in_flight(error)
        self._fail_queued(error)


def _ignore(future: asyncio.Future[Any]) -> None:
    """A reply nobody needs (a `SCRIPT LOAD`): its error, if any, shows in the retry's."""
    if not future.cancelled():
        future.exception()


def _ssl_context(options: Mapping[str, object]) -> ssl.SSLContext:
    # `options` comes from parse_url: its query-string keys (ssl_cert_reqs) are not in ConnectKwargs.
    context = ssl.create_default_context()
    if options.get("ssl_cert_reqs") in {"none", "optional"}:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class _SubscriberProtocol(asyncio.Protocol):
    def __init__(self, subscriber: "RedisSubscriber", setup_replies: int) -> None:
        self._subscriber = subscriber
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._setup_replies = setup_replies

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            if self._setup_replies:
                self._setup_replies -= 1
                if isinstance(reply, ResponseError):
                    self._subscriber._setup_refused(self, reply)
                    return
                continue
            self._subscriber._push(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._subscriber._lost(self, exc)


class RedisSubscriber:
    """One pub/sub connection whose SUBSCRIBE and UNSUBSCRIBE commands are batched per event-loop
    iteration; each message goes to `on_message(channel, data)` from the protocol callback.

    If the connection drops, `on_lost()` is called (every subscription is gone with it: messages
    published meanwhile are lost, as pub/sub keeps nothing) and the next `subscribe` reconnects.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        on_message: Callable[[bytes, bytes], None],
        on_lost: Callable[[], None],
    ) -> None:
        self._endpoint = Endpoint(url)
        self._timeout_s = timeout_s
        self._on_message = on_message
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._protocol: _SubscriberProtocol | None = None
        self._connecting: asyncio.Future[None] | None = None
        self._to_subscribe: list[bytes] = []
        self._to_unsubscribe: list[bytes] = []
        self._confirmations: dict[bytes, asyncio.Future[None]] = {}
        self._flush_scheduled = False

    async def subscribe(self, channel: str) -> None:
        """Subscribe; returns once Redis has confirmed, so a message published now is received.

        Raises:
            redis.exceptions.ConnectionError: no connection, or the connection dropped first.
            TimeoutError: Redis did not confirm within `timeout_s`.
        """
        if self._transport is None or self._transport.is_closing():
            await self._ensure_connected()
        name = channel.encode()
        confirmed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._confirmations[name] = confirmed
        self._to_subscribe.append(name)
        self._schedule_flush()
        try:
            async with asyncio.timeout(self._timeout_s):
                await confirmed
        finally:
            self._confirmations.pop(name, None)

    def unsubscribe(self, channel: str) -> None:
        """Stop receiving `channel` (sent with the next batch; nothing to wait for)."""
        if self._transport is not None and not self._transport.is_closing():
            self._to_unsubscribe.append(channel.encode())
            self._schedule_flush()

    async def aclose(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._transport = self._protocol = None

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._transport is None or self._transport.is_closing():
            return
        commands = []
        if self._to_subscribe:
            commands.append(pack(("SUBSCRIBE", *self._to_subscribe)))
            self._to_subscribe = []
        if self._to_unsubscribe:
            commands.append(pack(("UNSUBSCRIBE", *self._to_unsubscribe)))
            self._to_unsubscribe = []
        if commands:
            self._transport.write(b"".join(commands))

    async def _ensure_connected(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(_ignore)  # each waiter gets the error; none may remain
        await asyncio.shield(self._connecting)

    async def _connect(self) -> None:
        try:
            setup = len(self._endpoint.setup)
            transport, protocol = await self._endpoint.connect(
                lambda: _SubscriberProtocol(self, setup), self._timeout_s
            )
            transport.write(b"".join(pack(command) for command in self._endpoint.setup))
            self._transport, self._protocol = transport, protocol
        finally:
            self._connecting = None

    def _push(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind, channel = reply[0], reply[1]
        if kind == b"message":
            self._on_message(channel, reply[2])
        elif kind == b"subscribe":
            confirmed = self._confirmations.get(channel)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)

    def _setup_refused(self, protocol: _SubscriberProtocol, reply: ResponseError) -> None:
        if protocol is self._protocol and self._transport is not None:
            self._transport.abort()

    def _lost(self, protocol: _SubscriberProtocol, exc: Exception | None) -> None:
        if protocol is not self._protocol:
            return
        self._transport = self._protocol = None
        self._to_subscribe, self._to_unsubscribe = [], []
        error = RedisConnectionError(f"Subscriber connection lost: {exc!r}")
        for confirmed in self._confirmations.values():
            if not confirmed.done():
                confirmed.set_exception(error)
        self._on_lost()
