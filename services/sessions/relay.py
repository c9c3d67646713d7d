"""Receives token chunks from Redis pub/sub for every job this process is streaming.

One subscriber connection per process, whatever the number of streams: a reader task
routes each message to its job's bounded queue. `open()` returns only once Redis has
confirmed the subscription, so the job can be published without losing its first chunk.
"""

import asyncio
import contextlib

import redis.asyncio as redis

from shared.errors import Unavailable
from shared.logging import get_logger

log = get_logger(__name__)

# Put in a stream's queue when the process stops relaying it (shutdown or overflow).
STREAM_LOST = b""


class TokenStream:
    """Chunks of one job, in arrival order."""

    def __init__(self, relay: "TokenRelay", channel: str, queue: asyncio.Queue[bytes]) -> None:
        self._relay = relay
        self.channel = channel
        self.queue = queue

    async def next(self, timeout_s: float) -> bytes:
        """Return the next raw chunk; raises TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            return await self.queue.get()

    async def close(self) -> None:
        await self._relay.close(self)


class TokenRelay:
    """Shared pub/sub subscriber that fans chunks out to per-job queues."""

    def __init__(
        self, client: redis.Redis, *, home_channel: str, buffer_chunks: int, subscribe_timeout_s: float
    ) -> None:
        self._redis = client
        self._pubsub = client.pubsub()
        self._buffer_chunks = buffer_chunks
        self._subscribe_timeout_s = subscribe_timeout_s
        self._queues: dict[str, asyncio.Queue[bytes]] = {}
        self._confirmations: dict[str, asyncio.Future[None]] = {}
        # A subscription of our own keeps the connection in subscriber mode while idle.
        self._home_channel = home_channel
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        await self._pubsub.subscribe(self._home_channel)
        self._reader = asyncio.create_task(self._read_forever())

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for queue in self._queues.values():
            queue.put_nowait(STREAM_LOST)
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()

    @property
    def active_streams(self) -> int:
        return len(self._queues)

    async def open(self, channel: str) -> TokenStream:
        """Subscribe to `channel` and wait until Redis confirms it.

        Raises:
            Unavailable: Redis did not confirm in time.
        """
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=self._buffer_chunks)
        confirmed = asyncio.get_running_loop().create_future()
        self._queues[channel] = queue
        self._confirmations[channel] = confirmed
        try:
            await self._pubsub.subscribe(channel)
            await asyncio.wait_for(confirmed, self._subscribe_timeout_s)
        except (TimeoutError, redis.RedisError, OSError) as exc:
            self._queues.pop(channel, None)
            self._confirmations.pop(channel, None)
            log.warning("subscribe_failed", channel=channel, error=repr(exc))
            raise Unavailable("The token stream could not be opened; try again.", retry_after_s=1) from exc
        return TokenStream(self, channel, queue)

    async def close(self, stream: TokenStream) -> None:
        self._queues.pop(stream.channel, None)
        self._confirmations.pop(stream.channel, None)
        with contextlib.suppress(Exception):
            await self._pubsub.unsubscribe(stream.channel)

    async def _read_forever(self) -> None:
        while True:
            try:
                message = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the connection is retried by redis-py
                log.warning("relay_read_failed", error=repr(exc))
                await asyncio.sleep(0.2)
                continue
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict) -> None:
        channel = message["channel"].decode()
        kind = message["type"]
        if kind == "message":
            queue = self._queues.get(channel)
            if queue is None:
                return
            try:
                queue.put_nowait(message["data"])
            except asyncio.QueueFull:
                # The client reads slower than the model writes: cut it off rather than
                # let one stream hold unbounded memory.
                self._queues.pop(channel, None)
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
                queue.put_nowait(STREAM_LOST)
        elif kind == "subscribe":
            confirmed = self._confirmations.pop(channel, None)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)
