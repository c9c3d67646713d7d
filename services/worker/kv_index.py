"""This worker's part of the prefix index (`shared/prefix_index.py`): its engine's KV-cache events
(vLLM's `BlockStored`, `BlockRemoved`, `AllBlocksCleared`; the simulator's, the same) turned into
the set of prompt anchors whose prefix the engine holds, kept in Redis.

- **Blocks, keyed by their tokens.** A stored block's key is the hash of its parent's key, its
  adapter and its token ids (as Dynamo's KV router re-keys vLLM's blocks): the events carry the
  tokens, so the engine's own block hashes (vLLM's `prefix_caching_hash_algo`, its seed and
  `PYTHONHASHSEED`) need not be reproduced. The engine's hash is kept only to read its removals.
- **Anchors, from the prompts the engine renders.** For each new request the engine reports its
  rendered text, token ids and each token's end in the text (`RenderedPrompt`); each anchor's end
  in the content is found in the text, and the anchor is tied to the last whole block before it.
  An anchor is in the worker's set while its block is stored. A tie lasts while its block is
  stored (its removal unties it: the next prompt that holds the anchor ties it again, before its
  blocks are stored again), and a tie to a block not stored yet (a prompt being prefilled, or one
  the engine never caches) waits among the last `max_pending` such: the anchors' memory follows
  what the engine's cache holds, not how many prompts were ever seen.
- **Gaps.** Batches carry sequence numbers. A gap is filled from the engine's replay buffer
  (vLLM's replay endpoint), and after a second without a batch the buffer is asked for any batch
  lost at the end of a burst; what the buffer no longer holds, or a publisher that started again
  (an engine restarted), empties the set and starts afresh (a resync): the index then holds less
  than the engine, which costs cache misses, never a request.
- **Redis.** Changes go out every `FLUSH_INTERVAL_S` in one pipelined write, with the set's
  expiry (refreshed every `REFRESH_INTERVAL_S` while nothing changes). A failed write, or a write
  that finds the set gone (Redis restarted empty), makes the next write replace the set whole. At a
  drain the set is deleted.
"""

import asyncio
import hashlib
import itertools
import time
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.worker.engines.base import GenerationRequest
from services.worker.engines.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventSource,
    RenderedPrompt,
)
from shared.logging import get_logger
from shared.names import Names
from shared.outages import Outage
from shared.prefix_index import PREFIX_INDEX_TTL_S, anchors
from shared.redis_pipe import RedisPipe

log = get_logger(__name__)

# How often the worker writes its changes to Redis (and how stale the index is at most, beyond
# the engine's own publishing).
FLUSH_INTERVAL_S = 0.05
# The set's expiry is refreshed at least this often while nothing changes.
REFRESH_INTERVAL_S = 5.0
# How long a replay request may take before the gap is resynced instead.
REPLAY_TIMEOUT_S = 2.0
# After this long without a batch, the engine's replay buffer is asked for any batch lost at the
# end of a burst (a lost batch is otherwise seen only when the next one comes).
IDLE_PROBE_S = 1.0


@dataclass(slots=True)
class _Changes:
    added: set[bytes] = field(default_factory=set)
    removed: set[bytes] = field(default_factory=set)
    # The set must be written whole (a resync, or a write that failed).
    whole: bool = True
    # The publishing time of the newest batch applied since the last write.
    newest_ts: float | None = None


class KvIndexMetrics(Protocol):
    def index_size(self, blocks: int, anchors: int) -> None: ...

    def index_lag(self, seconds: float) -> None: ...

    def gap(self, healed: str) -> None: ...


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A block's key: its parent's key and its tokens."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def root_key(adapter: str | None) -> bytes:
    """The parent key of a prompt's first block (the adapter's blocks are apart from the base model's)."""
    return hashlib.blake2b((adapter or "").encode(), digest_size=16).digest()


class KvIndex:
    """The anchors this worker's engine holds, from its events, written to Redis."""

    def __init__(
        self,
        pipe: RedisPipe,
        names: Names,
        *,
        model: str,
        worker_id: str,
        block_size: int,
        max_pending: int,
        metrics: KvIndexMetrics | None = None,
    ) -> None:
        self._pipe = pipe
        self._key = names.prefix_index(model, worker_id)
        self._block_size = block_size
        self._max_pending = max_pending
        self._metrics = metrics
        # The engine's block hash -> the block's key; the keys of the blocks the engine holds.
        self._by_engine: dict[Hashable, bytes] = {}
        self._held: set[bytes] = set()
        # Anchor -> the block it needs, and the other way round.
        self._anchor_block: dict[bytes, bytes] = {}
        self._block_anchors: dict[bytes, set[bytes]] = {}
        # The anchors tied to a block not stored (oldest tie first).
        self._pending: OrderedDict[bytes, None] = OrderedDict()
        self._changes = _Changes()
        self._last_seq: int | None = None
        self._outage = Outage("prefix_index", first_s=0.5, cap_s=5.0)
        self._withdrawn = False
        self._last_write = 0.0
        self._last_size = 0.0
        # The set should exist in Redis (something was written to it since it was last emptied).
        self._expected = False

    @property
    def last_seq(self) -> int | None:
        return self._last_seq

    @property
    def tied(self) -> int:
        """How many anchors are tied to a block (stored or not): what the index's memory follows."""
        return len(self._anchor_block)

    def held_anchors(self) -> set[bytes]:
        return {a for a, block in self._anchor_block.items() if block in self._held}

    # -- prompts ----------------------------------------------------------------------------

    def observe(self, request: GenerationRequest, prompt: RenderedPrompt) -> None:
        """Tie the anchors of a new request's prompt to the blocks that end before them."""
        if request.resume is not None:
            return
        found = anchors(messages=request.messages, prompt=request.prompt, tools=request.tools, adapter=request.adapter)
        if not found:
            return
        size = self._block_size
        keys: list[bytes] = []
        parent = root_key(request.adapter)
        ids = prompt.token_ids
        for end in range(size, len(ids) + 1, size):
            parent = block_key(parent, ids[end - size : end])
            keys.append(parent)
        contents = [m.content for m in request.messages] if request.messages is not None else [request.prompt or ""]
        starts = _content_starts(prompt.text, contents)
        for anchor in found:
            if anchor.part >= len(starts):
                break
            tokens = bisect_right(prompt.token_ends, starts[anchor.part] + anchor.end)
            blocks = min(tokens, len(ids)) // size
            if blocks == 0:
                continue
            self._tie(anchor.key, keys[blocks - 1])

    def _tie(self, anchor: bytes, block: bytes) -> None:
        old = self._anchor_block.get(anchor)
        if old is not None and old != block:
            self._untie(anchor, old)
            if old in self._held:
                self._remove(anchor)
        self._anchor_block[anchor] = block
        self._block_anchors.setdefault(block, set()).add(anchor)
        if block in self._held:
            self._pending.pop(anchor, None)
            self._add(anchor)
            return
        self._pending[anchor] = None
        self._pending.move_to_end(anchor)
        self._trim_pending()

    def _trim_pending(self) -> None:
        while len(self._pending) > self._max_pending:
            forgotten, _ = self._pending.popitem(last=False)
            self._untie(forgotten, self._anchor_block.pop(forgotten))

    def _untie(self, anchor: bytes, block: bytes) -> None:
        tied = self._block_anchors.get(block)
        if tied is not None:
            tied.discard(anchor)
            if not tied:
                del self._block_anchors[block]

    # -- events -----------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch (in sequence order)."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for engine_hash in event.block_hashes:
                    key = self._by_engine.pop(engine_hash, None)
                    if key is not None:
                        self._held.discard(key)
                        for anchor in self._block_anchors.pop(key, ()):
                            del self._anchor_block[anchor]
                            self._remove(anchor)
            else:
                self._clear()
        self._last_seq = batch.seq
        self._changes.newest_ts = batch.ts

    def _stored(self, event: BlockStored) -> None:
        if event.parent_block_hash is None:
            parent: bytes | None = root_key(event.lora_name)
        else:
            parent = self._by_engine.get(event.parent_block_hash)
        if parent is None:
            return  # its parent was stored before a resync: unknown until stored again
        size = event.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            parent = block_key(parent, event.token_ids[i * size : (i + 1) * size])
            self._by_engine[engine_hash] = parent
            self._held.add(parent)
            for anchor in self._block_anchors.get(parent, ()):
                self._pending.pop(anchor, None)
                self._add(anchor)

    def _clear(self) -> None:
        self._by_engine.clear()
        self._held.clear()
        # Every tie waits for its block to be stored again (a prompt rendered before the gap was
        # seen may be stored after it), those of blocks that were stored first out.
        pending = OrderedDict.fromkeys(a for a in self._anchor_block if a not in self._pending)
        pending.update(self._pending)
        self._pending = pending
        self._trim_pending()
        self._changes = _Changes(whole=True, newest_ts=self._changes.newest_ts)

    def _add(self, anchor: bytes) -> None:
        self._changes.removed.discard(anchor)
        self._changes.added.add(anchor)

    def _remove(self, anchor: bytes) -> None:
        self._changes.added.discard(anchor)
        self._changes.removed.add(anchor)

    async def follow(self, source: KvEventSource) -> None:
        """Apply the engine's batches as they come, healing gaps (runs until cancelled). A gap is
        seen at the next batch; one at the end of a burst, by asking the replay buffer after
        `IDLE_PROBE_S` without a batch."""
        while True:
            try:
                async with asyncio.timeout(IDLE_PROBE_S):
                    batch = await source.next_batch()
            except TimeoutError:
                await self._catch_up(source)
                continue
            except Exception as exc:  # noqa: BLE001 - a batch that cannot be read is a gap, seen at the next
                log.warning("kv_events_unreadable", error=repr(exc))
                continue
            expected = 0 if self._last_seq is None else self._last_seq + 1
            if batch.seq < expected:
                if batch.seq != 0:
                    continue  # already applied from the replay buffer
                # The publisher counts from 0 again: the engine started afresh, with an empty cache.
                log.warning("kv_events_restarted", seq=batch.seq, expected=expected)
                self._resync("restart")
            elif batch.seq > expected:
                await self._heal(source, expected, batch)
            self.apply(batch)

    async def _catch_up(self, source: KvEventSource) -> None:
        """Apply what the engine's replay buffer holds past the last batch applied (batches lost at
        the end of a burst, which no later batch reveals)."""
        expected = 0 if self._last_seq is None else self._last_seq + 1
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                replayed = await source.replay(expected)
        except Exception as exc:  # noqa: BLE001 - tried again after the next quiet spell
            log.warning("kv_events_replay_failed", error=repr(exc), expected=expected)
            return
        applied = 0
        for batch in replayed:
            if batch.seq != expected + applied:
                break
            self.apply(batch)
            applied += 1
        if applied:
            log.info("kv_events_replayed", start=expected, batches=applied)
            if self._metrics is not None:
                self._metrics.gap("replay")

    async def _heal(self, source: KvEventSource, expected: int, batch: EventBatch) -> None:
        """Fill the batches from `expected` to `batch` from the engine's replay buffer; what it
        cannot give, resync."""
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                replayed = await source.replay(expected)
        except Exception as exc:  # noqa: BLE001 - a replay that fails is healed by a resync
            log.warning("kv_events_replay_failed", error=repr(exc), expected=expected)
            replayed = []
        missing = [b for b in replayed if expected <= b.seq < batch.seq]
        if missing and missing[0].seq == expected and all(b.seq == a.seq + 1 for a, b in itertools.pairwise(missing)):
            for replayed_batch in missing:
                self.apply(replayed_batch)
            log.info("kv_events_replayed", start=expected, batches=len(missing))
            if self._metrics is not None:
                self._metrics.gap("replay")
            return
        log.warning("kv_events_gap", expected=expected, got=batch.seq, replayed=len(missing))
        self._resync("resync")

    def _resync(self, healed: str) -> None:
        self._clear()
        if self._metrics is not None:
            self._metrics.gap(healed)

    # -- Redis ------------------------------------------------------------------------------

    async def write(self) -> None:
        """Write what changed since the last write (the whole set when it must be), with its
        expiry; a failure marks the set to be written whole next time."""
        if self._withdrawn:
            return
        changes = self._changes
        now = time.monotonic()
        if not (changes.added or changes.removed or changes.whole) and now - self._last_write < REFRESH_INTERVAL_S:
            return
        self._changes = _Changes(whole=False)
        replies = []
        if changes.whole:
            replies.append(self._pipe.submit("DEL", self._key))
            members = self.held_anchors()
        else:
            # Whether the set is still there: Redis may have lost it (restarted empty).
            replies.append(self._pipe.submit("EXISTS", self._key))
            if changes.removed:
                replies.append(self._pipe.submit("SREM", self._key, *changes.removed))
            members = changes.added
        if members:
            replies.append(self._pipe.submit("SADD", self._key, *members))
        replies.append(self._pipe.submit("EXPIRE", self._key, PREFIX_INDEX_TTL_S))
        results = await asyncio.gather(*replies, return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self._outage.failed(failure, fallback="the index is written whole once Redis is back")
            self._changes.whole = True
            return
        self._outage.recovered()
        self._last_write = now
        if not changes.whole and results[0] == 0 and self._expected:
            # The set was gone before this write: Redis lost it. Written whole at the next write.
            self._changes.whole = True
        self._expected = bool(members) or (self._expected and not changes.whole)
        if self._metrics is not None:
            if changes.newest_ts is not None:
                self._metrics.index_lag(max(0.0, time.time() - changes.newest_ts))
            if now - self._last_size >= 1.0:  # counting the anchors walks them all: once a second
                self._last_size = now
                self._metrics.index_size(len(self._held), len(self.held_anchors()))

    async def keep_written(self) -> None:
        """Write the changes every `FLUSH_INTERVAL_S` (runs until cancelled)."""
        while True:
            await self.write()
            await asyncio.sleep(FLUSH_INTERVAL_S)

    async def withdraw(self) -> None:
        """The worker drains: its set goes, and is not written again."""
        self._withdrawn = True
        try:
            await self._pipe.execute("DEL", self._key)
        except Exception as exc:  # noqa: BLE001 - the set expires on its own anyway
            log.warning("prefix_index_withdraw_failed", error=repr(exc))


def _content_starts(text: str, contents: Sequence[str]) -> list[int]:
    """Where each of `contents` starts in the rendered `text`, in order; cut at the first not
    found (the anchors after it cannot be placed)."""
    starts: list[int] = []
    cursor = 0
    for content in contents:
        at = text.find(content, cursor)
        if at < 0:
            break
        starts.append(at)
        cursor = at + len(content)
    return starts
