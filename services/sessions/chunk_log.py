"""A job's chunks read back from its log in Redis, for a client that reconnects to its stream.

A job that asks for it (`Job.chunk_log_ttl_s`) has its worker append every chunk it publishes to a
capped stream (`Names.chunk_log`), in the same script call as the publish
(`services/worker/chunk_publisher.py`): entry `0-<seq + 1>`, field `c` the chunk's JSON, each seq once.
The log outlives the session manager that relayed the job, and a worker that takes a job over
continues it, so any replica can replay the whole answer in order, and follow it live until its
final chunk.

A stream a client resumes through the chat API also has its meta (`StreamMeta`, `Names.chunk_log_meta`):
whose it is and what its events carry besides the chunks, written by the session manager that
started its job.

Reads go through a redis-py client of their own (`resources.py`), never the hot path's pipe: a
page of a thousand chunks, or an `XREAD BLOCK` holding its connection, must not delay the commands
pipelined behind them, nor take the session store's pooled connections.
"""

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import redis.asyncio as redis
from pydantic import ValidationError

from shared.logging import get_logger
from shared.names import Names
from shared.schemas import TokenChunk

log = get_logger(__name__)

# Chunks one read asks Redis for: replay costs one round trip per page.
PAGE = 1000


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """What a resumed chat stream needs besides its chunks: the tenant it belongs to, and the
    fields its events repeat (`model`, `created`), whether it ends with a usage event and carries
    logprobs, and its job's deadline (no chunk comes after it). `traceparent`: the span of the
    request that started it (tracing on), which a resume's span links to."""

    tenant: str
    model: str
    created: int
    include_usage: bool
    logprobs: bool
    deadline: float
    traceparent: str | None = None

    def dumps(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes | str) -> "StreamMeta":
        return cls(**orjson.loads(raw))


class ChunkLog:
    """Reads jobs' chunk logs. `block_s`: the longest one `XREAD BLOCK` waits, below the client's
    command timeout (a longer wait is made of several)."""

    def __init__(self, client: redis.Redis, names: Names, *, block_s: float) -> None:
        self._client = client
        self._names = names
        self._block_ms = max(1, int(block_s * 1000))

    async def read(self, job_id: str, after_seq: int, count: int = PAGE) -> list[TokenChunk]:
        """Up to `count` logged chunks of the job with seq > `after_seq` (-1: from the first), in
        order; [] when there are none (or no log).

        Raises:
            redis.exceptions.RedisError: Redis is unreachable.
        """
        if count < 1:
            raise ValueError(f"count must be at least 1, not {count}")
        entries = await self._client.xrange(self._names.chunk_log(job_id), min=_after(after_seq), count=count)
        return _chunks(entries or [])

    async def last(self, job_id: str) -> TokenChunk | None:
        """The job's last logged chunk; None when there is none (or no log).

        Raises:
            redis.exceptions.RedisError: Redis is unreachable.
        """
        entries = await self._client.xrevrange(self._names.chunk_log(job_id), count=1)
        chunks = _chunks(entries or [])
        return chunks[0] if chunks else None

    async def meta(self, job_id: str) -> StreamMeta | None:
        """The job's stream meta; None when there is none (not a resumable chat stream, or expired).

        Raises:
            redis.exceptions.RedisError: Redis is unreachable.
        """
        raw = await self._client.get(self._names.chunk_log_meta(job_id))
        return StreamMeta.loads(raw) if raw is not None else None

    async def follow(self, job_id: str, after_seq: int, *, idle_timeout_s: float) -> AsyncGenerator[TokenChunk, None]:
        """The job's chunks with seq > `after_seq` (-1: from the first), in order: those logged,
        then each as its worker publishes it, ending after the final one (`finish_reason` set).

        Raises:
            TimeoutError: nothing new was logged for `idle_timeout_s` (the job is not running, or
                its log expired or never existed).
            redis.exceptions.RedisError: Redis is unreachable.
        """
        async for page in self.pages(job_id, after_seq, idle_timeout_s=idle_timeout_s):
            for chunk in page:
                yield chunk

    async def pages(self, job_id: str, after_seq: int, *, idle_timeout_s: float) -> AsyncIterator[list[TokenChunk]]:
        """`follow`'s chunks as Redis returns them, up to `PAGE` at a time (a replay writes each
        page at once); the last page ends with the final chunk.

        Raises:
            TimeoutError, redis.exceptions.RedisError: as `follow`.
        """
        key = self._names.chunk_log(job_id)
        position: str | bytes = _id(after_seq)
        idle_until = time.monotonic() + idle_timeout_s
        while True:
            wait_ms = int((idle_until - time.monotonic()) * 1000)
            if wait_ms <= 0:
                raise TimeoutError(f"No chunk of job {job_id} was logged for {idle_timeout_s} s.")
            # RESP2's reply: [[key, [(id, fields), ...]]], or None when the wait ended empty.
            reply: Any = await self._client.xread({key: position}, count=PAGE, block=min(wait_ms, self._block_ms))
            if not reply:
                continue
            entries = reply[0][1]
            position = entries[-1][0]
            page = _chunks(entries)
            for end, chunk in enumerate(page, 1):
                if chunk.finish_reason is not None:
                    yield page[:end]
                    return
            if page:
                yield page
            idle_until = time.monotonic() + idle_timeout_s


class LoggedStream:
    """A job's chunks from its log (`ChunkLog.follow`) as the relay's `TokenStream` gives them: raw
    JSON, one at a time. What a session turn whose relayed stream was lost reads on from."""

    index = 0
    ready = False

    def __init__(self, chunks: AsyncGenerator[TokenChunk, None]) -> None:
        self._chunks = chunks

    async def next(self, timeout_s: float) -> bytes:
        """The next logged chunk.

        Raises:
            TimeoutError: none came within `timeout_s` (then none ever comes: the read was called
                off), or as `follow`.
            redis.exceptions.RedisError: Redis is unreachable.
        """
        try:
            async with asyncio.timeout(timeout_s):
                chunk = await anext(self._chunks)
        except StopAsyncIteration:
            raise TimeoutError("The chunk log's read has ended.") from None
        return chunk.model_dump_json(exclude_none=True).encode()

    async def close(self) -> None:
        await self._chunks.aclose()


def _id(seq: int) -> str:
    """The log entry id of chunk `seq` (entry ids start at 0-1: 0-0 is not a valid one)."""
    return f"0-{seq + 1}"


def _after(seq: int) -> str:
    """An `XRANGE` start past chunk `seq`."""
    return "(" + _id(seq)


def _chunks(entries: Iterable[Any]) -> list[TokenChunk]:
    """The chunks of log entries as redis-py gives them: (id, {b"c": chunk JSON})."""
    chunks = []
    for entry_id, fields in entries:
        try:
            chunks.append(TokenChunk.model_validate_json(fields[b"c"]))
        except (KeyError, ValidationError):
            log.error("chunk_log_entry_invalid", entry_id=entry_id.decode())
    return chunks
