"""Receives token chunks from Redis pub/sub for every job this process is streaming.

One subscriber connection per process, whatever the number of streams: its protocol callback
routes each message to its job's bounded queue, and the SUBSCRIBE and UNSUBSCRIBE commands of
concurrent requests share writes (`shared/redis_pipe.py:RedisSubscriber`). A stream is handed out
only once Redis has confirmed its subscription, so its job can be published without losing its
first chunk.

A few streams are kept subscribed ahead, for job ids not yet used (`spare_streams`): a request
takes one at once instead of waiting a round trip to Redis for its subscription, and the relay
subscribes replacements in the background, in one batch.

A request for `n` choices has one job, and so one stream, per choice: `merge` routes them into one
queue, each chunk tagged with its choice's index, so they are relayed in arrival order.
"""

import asyncio
import contextlib
import uuid
from collections import deque
from typing import Any, Generic, TypeVar

from redis.exceptions import RedisError

from shared.errors import Unavailable
from shared.logging import get_logger
from shared.names import Names
from shared.redis_pipe import RedisSubscriber
from shared.tasks import BackgroundTasks

log = get_logger(__name__)

# Put in a stream's queue when the process stops relaying it (shutdown, overflow, or the
# subscriber connection dropped and chunks may have been lost).
STREAM_LOST = b""

_T = TypeVar("_T")


class Inbox(Generic[_T]):
    """A bounded first-in first-out buffer with one reader, which waits for its next item until a
    deadline: what `asyncio.Queue` under `asyncio.timeout` gives, for less. Every chunk of every
    stream passes one, and the reader waits for nearly each: a wait arms no timer of its own, a
    timer armed once for the reader's deadline (a request's) checks at that deadline whether the
    reader still waits, and sets itself again for a later deadline that a wait since gave.
    """

    __slots__ = ("_deadline", "_items", "_loop", "_maxsize", "_timer", "_waiter")

    def __init__(self, maxsize: int = 0) -> None:
        self._items: deque[_T] = deque()
        self._maxsize = maxsize
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return 0 < self._maxsize <= len(self._items)

    def put_nowait(self, item: _T) -> None:
        """Add `item`, waking the reader.

        Raises:
            asyncio.QueueFull: the buffer holds `maxsize` items.
        """
        if 0 < self._maxsize <= len(self._items):
            raise asyncio.QueueFull
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> _T:
        """The oldest item.

        Raises:
            asyncio.QueueEmpty: there is none.
        """
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self, timeout_s: float) -> _T:
        """The oldest item, once there is one.

        Raises:
            TimeoutError: none came within `timeout_s`.
        """
        while not self._items:
            loop = self._loop or asyncio.get_running_loop()
            self._loop = loop
            deadline = loop.time() + timeout_s
            self._deadline = deadline
            if self._timer is None or self._timer.when() > deadline:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = loop.call_at(deadline, self._check_deadline)
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def close(self) -> None:
        """Stop the deadline's timer (the reader is gone)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_deadline(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # the next wait sets the timer again
        assert self._loop is not None  # set by the wait
        if self._loop.time() >= self._deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)


class TokenStream:
    """Chunks of one job, in arrival order."""

    # The choice the chunk `next()` returned belongs to (a merged stream's vary).
    index = 0

    def __init__(self, relay: "TokenRelay", job_id: str, channel: str, queue: Inbox[bytes]) -> None:
        self._relay = relay
        self.job_id = job_id
        self.channel = channel
        self.queue = queue

    @property
    def ready(self) -> bool:
        """A chunk is waiting: the next `next()` returns without waiting."""
        return not self.queue.empty()

    async def next(self, timeout_s: float) -> bytes:
        """Return the next raw chunk; raises TimeoutError after `timeout_s`."""
        return await self.queue.get(timeout_s)

    async def close(self) -> None:
        self._relay.close(self)


class _ChoiceSink:
    """Where the relay puts the chunks of one choice of a merged stream: its queue, tagged."""

    __slots__ = ("index", "queue")

    def __init__(self, index: int, queue: Inbox[tuple[int, bytes]]) -> None:
        self.index = index
        self.queue = queue

    def put_nowait(self, data: bytes) -> None:
        self.queue.put_nowait((self.index, data))


class MergedStream:
    """Chunks of several jobs (the choices of one request), in arrival order; after `next()`,
    `index` says whose."""

    def __init__(self, relay: "TokenRelay", streams: list[TokenStream], queue: Inbox[tuple[int, bytes]]):
        self._relay = relay
        self.streams = streams
        self.queue = queue
        self.index = 0

    @property
    def ready(self) -> bool:
        return not self.queue.empty()

    async def next(self, timeout_s: float) -> bytes:
        """Return the next raw chunk of any choice (its index in `index`); raises TimeoutError after
        `timeout_s`."""
        self.index, data = await self.queue.get(timeout_s)
        return data

    async def close(self) -> None:
        self.queue.close()
        for stream in self.streams:
            self._relay.close(stream)


class TokenRelay:
    """Shared pub/sub subscriber that fans chunks out to per-job queues."""

    def __init__(
        self, url: str, names: Names, *, buffer_chunks: int, subscribe_timeout_s: float, spare_streams: int
    ) -> None:
        self._subscriber = RedisSubscriber(
            url, timeout_s=subscribe_timeout_s, on_message=self._dispatch, on_lost=self._lose_all
        )
        self._names = names
        self._buffer_chunks = buffer_chunks
        self._queues: dict[bytes, Inbox[bytes] | _ChoiceSink] = {}
        self._spare_target = spare_streams
        self._spares: list[TokenStream] = []
        self._refilling = False
        self._background = BackgroundTasks()

    async def stop(self) -> None:
        self._spare_target = 0
        self._lose_all()
        with contextlib.suppress(Exception):
            await self._subscriber.aclose()

    @property
    def active_streams(self) -> int:
        """Streams handed out and not yet closed."""
        return len(self._queues) - len(self._spares)

    async def open_job(self) -> TokenStream:
        """A confirmed subscription to a new job's channel (the job id is the stream's).

        Raises:
            Unavailable: Redis is unreachable or did not confirm in time.
        """
        stream = self._spares.pop() if self._spares else None
        if len(self._spares) < self._spare_target // 2 and not self._refilling:
            self._refilling = True
            self._background.spawn(self._refill())
        return stream if stream is not None else await self._subscribe(str(uuid.uuid4()))

    async def _subscribe(self, job_id: str) -> TokenStream:
        channel = self._names.tokens_channel(job_id)
        queue: Inbox[bytes] = Inbox(maxsize=self._buffer_chunks)
        name = channel.encode()
        self._queues[name] = queue
        try:
            await self._subscriber.subscribe(channel)
        except (TimeoutError, RedisError) as exc:
            self._queues.pop(name, None)
            self._subscriber.unsubscribe(channel)
            log.warning("subscribe_failed", channel=channel, error=repr(exc))
            raise Unavailable("The token stream could not be opened; try again.", retry_after_s=1) from exc
        return TokenStream(self, job_id, channel, queue)

    async def _refill(self) -> None:
        """Subscribe spare streams up to the target, all at once (one write)."""
        try:
            missing = self._spare_target - len(self._spares)
            streams = await asyncio.gather(
                *(self._subscribe(str(uuid.uuid4())) for _ in range(missing)), return_exceptions=True
            )
            for stream in streams:
                if not isinstance(stream, TokenStream):
                    continue  # Redis is down: requests subscribe on demand meanwhile
                if self._spare_target and stream.channel.encode() in self._queues:
                    self._spares.append(stream)
                else:
                    self.close(stream)
        finally:
            self._refilling = False

    def merge(self, streams: list[TokenStream]) -> MergedStream:
        """One stream of the chunks of `streams` (opened, their jobs not yet published), each
        tagged with its position in `streams`. Its buffer holds as many chunks as theirs did."""
        queue: Inbox[tuple[int, bytes]] = Inbox(maxsize=self._buffer_chunks * len(streams))
        for index, stream in enumerate(streams):
            name, sink = stream.channel.encode(), _ChoiceSink(index, queue)
            if self._queues.get(name) is stream.queue:
                self._queues[name] = sink
                while not stream.queue.empty():
                    sink.put_nowait(stream.queue.get_nowait())
            else:
                _end(sink)  # already lost (the subscriber connection dropped)
        return MergedStream(self, streams, queue)

    def close(self, stream: TokenStream) -> None:
        stream.queue.close()
        if self._queues.pop(stream.channel.encode(), None) is not None:
            self._subscriber.unsubscribe(stream.channel)

    def _dispatch(self, channel: bytes, data: bytes) -> None:
        queue = self._queues.get(channel)
        if queue is None:
            return
        try:
            queue.put_nowait(data)
        except asyncio.QueueFull:
            # The client reads slower than the model writes: cut it off rather than let one
            # stream hold unbounded memory.
            self._queues.pop(channel, None)
            self._subscriber.unsubscribe(channel.decode())
            _end(queue)

    def _lose_all(self) -> None:
        """Every stream ends: the subscriptions are gone (or going), and chunks may be lost."""
        queues, self._queues = self._queues, {}
        spares, self._spares = self._spares, []
        if len(queues) > len(spares):
            log.warning("relay_streams_lost", streams=len(queues) - len(spares))
        for queue in queues.values():
            _end(queue)


def _end(sink: Inbox[bytes] | _ChoiceSink) -> None:
    """End the stream: its reader gets what is queued, then STREAM_LOST (room is made for it
    by dropping the oldest chunk if the queue is full)."""
    queue: Inbox[Any] = sink.queue if isinstance(sink, _ChoiceSink) else sink
    with contextlib.suppress(asyncio.QueueEmpty):
        if queue.full():
            queue.get_nowait()
    sink.put_nowait(STREAM_LOST)
