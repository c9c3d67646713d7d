"""KV-cache events as engines publish them (vLLM's `vllm.distributed.kv_events`, whose shapes
these mirror), and the sources a worker reads them from: vLLM's ZeroMQ publisher
(`VllmKvEvents`) and the simulator's own (`SimKvEvents`).

vLLM publishes each batch as three frames (topic, sequence number as 8 big-endian bytes, msgpack
of `KVEventBatch`) on a PUB socket, and keeps the last `buffer_steps` batches for a ROUTER socket
that replays them from a sequence number, ending with sequence -1. The worker binds both on
`ipc://` paths of its own (`kv_events_endpoints`): nothing listens on a network port.
"""

import asyncio
import collections
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# vLLM's end-of-replay marker (a sequence number of -1).
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: Sequence[Hashable]
    parent_block_hash: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[Hashable]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One batch of events as the engine published it: its sequence number and time (Unix s)."""

    seq: int
    ts: float
    events: Sequence[KvEvent]


class KvEventSource(Protocol):
    """An engine's stream of KV-cache event batches."""

    async def next_batch(self) -> EventBatch:
        """The next batch published (waits for it)."""

    async def replay(self, start_seq: int) -> list[EventBatch]:
        """The batches from `start_seq` on that the engine still buffers (oldest first)."""

    def close(self) -> None:
        """Stop receiving."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A prompt as the engine renders it: the text, its token ids, and where each token ends in the text."""

    text: str
    token_ids: Sequence[int]
    token_ends: Sequence[int]


class SimKvEvents:
    """The simulator's event stream: its batches in memory, the last `buffer` kept for replay.
    `drop_every` (fault injection, `AXON_SIM_KV_EVENTS_DROP_EVERY`): every n-th batch is not
    delivered (it stays in the replay buffer), as a dropped message would be."""

    def __init__(self, *, buffer: int, drop_every: int = 0) -> None:
        self._seq = 0
        self._buffer: collections.deque[EventBatch] = collections.deque(maxlen=buffer)
        self._live: asyncio.Queue[EventBatch] = asyncio.Queue()
        self._drop_every = drop_every
        self.dropped = 0

    def publish(self, events: Sequence[KvEvent]) -> None:
        if not events:
            return
        batch = EventBatch(self._seq, time.time(), list(events))
        self._seq += 1
        self._buffer.append(batch)
        if self._drop_every and self._seq % self._drop_every == 0:
            self.dropped += 1
            return
        self._live.put_nowait(batch)

    async def next_batch(self) -> EventBatch:
        return await self._live.get()

    async def replay(self, start_seq: int) -> list[EventBatch]:
        return [batch for batch in self._buffer if batch.seq >= start_seq]

    def close(self) -> None:
        return


def kv_events_endpoints() -> tuple[str, str]:
    """The `ipc://` endpoints (events, replay) of this worker's vLLM publisher, in a directory of
    the process's own (a socket path must stay under ~100 characters)."""
    directory = tempfile.mkdtemp(prefix="axon-kv-")
    return f"ipc://{directory}/events", f"ipc://{directory}/replay"


class VllmKvEvents:
    """vLLM's ZeroMQ event stream (`ZmqEventPublisher`), read with pyzmq's asyncio sockets."""

    def __init__(self, endpoint: str, replay_endpoint: str, *, topic: str) -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._context = zmq.asyncio.Context.instance()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._replay_endpoint = replay_endpoint
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._replay_lock = asyncio.Lock()

    def _batch(self, seq_bytes: bytes, payload: bytes) -> EventBatch:
        decoded = self._decoder.decode(payload)
        return EventBatch(int.from_bytes(seq_bytes, "big"), decoded.ts, [_event(e) for e in decoded.events])

    async def next_batch(self) -> EventBatch:
        _, seq_bytes, payload = await self._sub.recv_multipart()
        return self._batch(seq_bytes, payload)

    async def replay(self, start_seq: int) -> list[EventBatch]:
        zmq = self._zmq
        async with self._replay_lock:
            dealer = self._context.socket(zmq.DEALER)
            try:
                dealer.connect(self._replay_endpoint)
                await dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
                batches: list[EventBatch] = []
                while True:
                    _, _, seq_bytes, payload = await dealer.recv_multipart()
                    if seq_bytes == _END_SEQ:
                        return batches
                    batches.append(self._batch(seq_bytes, payload))
            finally:
                dealer.close(linger=0)

    def close(self) -> None:
        """Stop receiving, and remove the sockets' directory (`kv_events_endpoints`)."""
        with contextlib.suppress(Exception):
            self._sub.close(linger=0)
        shutil.rmtree(os.path.dirname(self._replay_endpoint.removeprefix("ipc://")), ignore_errors=True)


def _event(event: Any) -> KvEvent:
    """One of vLLM's events as ours; a store or removal of another medium than the GPU's (an
    offloading tier) or of another KV-cache group than the first counts as nothing."""
    kind = type(event).__name__
    medium = getattr(event, "medium", None)
    group = getattr(event, "group_idx", None)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if medium not in (None, "GPU") or group not in (None, 0):
        return BlockRemoved(())
    if kind == "BlockStored":
        return BlockStored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            int(event.block_size),
            getattr(event, "lora_name", None),
        )
    return BlockRemoved(list(event.block_hashes))
