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
from typing import Any

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


class TokenStream:
    """Chunks of one job, in arrival order."""

    # The choice the chunk `next()` returned belongs to (a merged stream's vary).
    index = 0

    def __init__(self, relay: "TokenRelay", job_id: str, channel: str, queue: asyncio.Queue[bytes]) -> None:
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
        if not self.queue.empty():
            return self.queue.get_nowait()
        async with asyncio.timeout(timeout_s):
            return await self.queue.get()

    async def close(self) -> None:
        self._relay.close(self)


class _ChoiceSink:
    """Where the relay puts the chunks of one choice of a merged stream: its queue, tagged."""

    __slots__ = ("index", "queue")

    def __init__(self, index: int, queue: "asyncio.Queue[tuple[int, bytes]]") -> None:
        self.index = index
        self.queue = queue

    def put_nowait(self, data: bytes) -> None:
        self.queue.put_nowait((self.index, data))


class MergedStream:
    """Chunks of several jobs (the choices of one request), in arrival order; after `next()`,
    `index` says whose."""

    def __init__(self, relay: "TokenRelay", streams: list[TokenStream], queue: asyncio.Queue[tuple[int, bytes]]):
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
        if not self.queue.empty():
            self.index, data = self.queue.get_nowait()
            return data
        async with asyncio.timeout(timeout_s):
            self.index, data = await self.queue.get()
        return data

    async def close(self) -> None:
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
        self._queues: dict[bytes, asyncio.Queue[bytes] | _ChoiceSink] = {}
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
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=self._buffer_chunks)
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
        queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue(maxsize=self._buffer_chunks * len(streams))
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


def _end(sink: asyncio.Queue[bytes] | _ChoiceSink) -> None:
    """End the stream: its reader gets what is queued, then STREAM_LOST (room is made for it
    by dropping the oldest chunk if the queue is full)."""
    queue: asyncio.Queue[Any] = sink.queue if isinstance(sink, _ChoiceSink) else sink
    with contextlib.suppress(asyncio.QueueEmpty):
        if queue.full():
            queue.get_nowait()
    sink.put_nowait(STREAM_LOST)
