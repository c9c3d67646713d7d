"""services.worker.kv_index.KvIndex fed by the simulator's own KV-cache events: anchors tied to the
blocks the engine holds, evictions, gaps healed by replay or by a resync, a publisher that starts
again; and the prompt's anchors (shared/prefix_index.py)."""

import asyncio

import pytest

from services.worker.engines.base import GenerationRequest
from services.worker.engines.kv_events import BlockStored, EventBatch, SimKvEvents
from services.worker.engines.sim import SimEngine
from services.worker.kv_index import KvIndex, block_key, root_key
from shared.names import Names
from shared.prefix_index import ANCHOR_CHARS, anchors
from shared.schemas import Message, Sampling


class Gaps:
    def __init__(self) -> None:
        self.healed: list[str] = []

    def index_size(self, blocks: int, anchors: int) -> None:
        del blocks, anchors

    def index_lag(self, seconds: float) -> None:
        del seconds

    def gap(self, healed: str) -> None:
        self.healed.append(healed)


def document(tag: str, chars: int = 6000) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(f"{tag}{len(words)}")
    return " ".join(words)


def chat(doc: str, question: str, request_id: str = "r") -> GenerationRequest:
    messages = [
        Message(role="system", content="Answer from the document."),
        Message(role="user", content=f"{doc}\n\nQuestion: {question}"),
    ]
    return GenerationRequest(request_id=request_id, sampling=Sampling(max_tokens=2, seed=1), messages=messages)


def request_anchors(request: GenerationRequest) -> list[bytes]:
    return [a.key for a in anchors(messages=request.messages, prompt=request.prompt)]


async def engine_and_index(
    kv_blocks: int = 4096, *, drop_every: int = 0, buffer: int = 1000, max_pending: int = 10_000
) -> tuple[SimEngine, KvIndex, SimKvEvents, Gaps]:
    events = SimKvEvents(buffer=buffer, drop_every=drop_every)
    sim = SimEngine(
        model_name="sim", ttft_ms=0, itl_ms=0, max_seqs=4, context_tokens=1 << 20, kv_blocks=kv_blocks, kv_events=events
    )
    await sim.start()
    gaps = Gaps()
    index = KvIndex(
        None,  # type: ignore[arg-type]  # never written to Redis here
        Names("t"),
        model="sim",
        worker_id="w1",
        block_size=sim.kv_block_size,
        max_pending=max_pending,
        metrics=gaps,
    )
    sim.prompt_observer = index.observe
    return sim, index, events, gaps


async def run(sim: SimEngine, request: GenerationRequest) -> int:
    outputs = [o async for o in sim.generate(request)]
    return outputs[-1].cached_tokens


async def follow_all(index: KvIndex, events: SimKvEvents) -> None:
    """Let the index follow every batch delivered so far."""
    follower = asyncio.create_task(index.follow(events))
    while not events._live.empty():
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    follower.cancel()
    await asyncio.gather(follower, return_exceptions=True)


async def test_the_anchors_of_a_served_document_are_held_up_to_the_last_whole_block() -> None:
    sim, index, events, _ = await engine_and_index()
    request = chat(document("a"), "what is a1?")
    await run(sim, request)
    await follow_all(index, events)
    keys = request_anchors(request)
    held = index.held_anchors()
    # Every anchor of the document is held but the ones past the prompt's last whole block (and
    # the system prompt's, within the first block).
    assert len(keys) > 20
    assert keys[0] not in held
    assert set(keys[1:-2]) <= held
    # Another question about the same document shares all anchors but its last ones.
    other = request_anchors(chat(document("a"), "and a2?"))
    shared = len([k for k in other if k in held])
    assert shared >= len(other) - 2
    assert not set(request_anchors(chat(document("b"), "what is b1?"))) & held


async def test_evicted_blocks_take_their_anchors_out() -> None:
    # About 1,200 words a document (75 blocks): 100 blocks hold one, not two.
    sim, index, events, _ = await engine_and_index(kv_blocks=100)
    first, second = chat(document("a"), "q"), chat(document("b"), "q")
    await run(sim, first)
    await run(sim, second)
    await follow_all(index, events)
    held = index.held_anchors()
    assert set(request_anchors(second)[1:-2]) <= held
    # The first document's tail went first (as vLLM frees blocks): its start alone is claimed.
    first_held = [key in held for key in request_anchors(first)]
    kept = first_held.index(False, 1)
    assert 1 < kept < len(first_held) // 2
    assert not any(first_held[kept:])


async def test_the_anchors_remembered_follow_the_cache_not_the_prompts_ever_seen() -> None:
    # 100 blocks hold one document of 75; twenty are asked about in turn.
    sim, index, events, _ = await engine_and_index(kv_blocks=100)
    requests = [chat(document(f"d{i}x"), "q", request_id=str(i)) for i in range(20)]
    for request in requests:
        await run(sim, request)
        await follow_all(index, events)
    per_document = len(request_anchors(requests[0]))
    assert index.tied <= 2 * per_document
    # An evicted document asked again is claimed again.
    again = chat(document("d0x"), "q", request_id="again")
    await run(sim, again)
    await follow_all(index, events)
    assert set(request_anchors(again)[1:-2]) <= index.held_anchors()


async def test_anchors_whose_blocks_are_never_stored_are_remembered_up_to_a_bound() -> None:
    sim, index, events, _ = await engine_and_index(kv_blocks=0, max_pending=50)
    for i in range(10):
        await run(sim, chat(document(f"d{i}x"), "q", request_id=str(i)))
    await follow_all(index, events)
    assert index.tied == 50
    assert not index.held_anchors()


async def test_a_lost_batch_is_replayed_from_the_engines_buffer() -> None:
    sim, index, events, gaps = await engine_and_index(drop_every=2)
    requests = [chat(document(tag), "q", request_id=tag) for tag in "abc"]
    for request in requests:
        await run(sim, request)
    assert events.dropped > 0
    await follow_all(index, events)
    assert "replay" in gaps.healed and "resync" not in gaps.healed
    held = index.held_anchors()
    for request in requests:
        assert set(request_anchors(request)[1:-2]) <= held


async def test_a_gap_the_buffer_no_longer_holds_starts_the_index_afresh() -> None:
    sim, index, events, gaps = await engine_and_index(drop_every=2, buffer=1)
    old = chat(document("a"), "q", request_id="a")
    await run(sim, old)  # its prompt's batch (its answer fills no new block)
    await run(sim, chat(document("b"), "q", request_id="b"))  # lost, and gone from the buffer
    newer = chat(document("c"), "q", request_id="c")
    await run(sim, newer)  # the gap is seen here
    assert events.dropped == 1
    await follow_all(index, events)
    assert gaps.healed == ["resync"]
    # What was stored before the resync is not claimed: a miss at worst, never a wrong claim.
    held = index.held_anchors()
    assert not set(request_anchors(old)) & held
    assert set(request_anchors(newer)[1:-2]) <= held


async def test_a_publisher_counting_from_zero_again_clears_the_index() -> None:
    _, index, _, gaps = await engine_and_index()
    tokens = list(range(16))
    index.apply(EventBatch(0, 0.0, [BlockStored(["h1"], None, tokens, 16)]))
    index.apply(EventBatch(1, 0.0, []))

    class Restarted:
        async def next_batch(self) -> EventBatch:
            if calls:
                raise asyncio.CancelledError
            calls.append(1)
            return EventBatch(0, 0.0, [])

        async def replay(self, start_seq: int) -> list[EventBatch]:
            return []

        def close(self) -> None:
            return

    calls: list[int] = []
    with pytest.raises(asyncio.CancelledError):
        await index.follow(Restarted())
    assert gaps.healed == ["restart"]
    assert index.last_seq == 0
    # The block stored before is forgotten with its engine hash.
    index.apply(EventBatch(1, 0.0, [BlockStored(["h2"], "h1", tokens, 16)]))
    assert block_key(block_key(root_key(None), tokens), tokens) not in index._held


def test_anchors_are_cut_every_anchor_chars_and_at_each_messages_end() -> None:
    content = "x" * (ANCHOR_CHARS * 2 + 10)
    messages = [Message(role="system", content="short"), Message(role="user", content=content)]
    found = anchors(messages=messages, prompt=None)
    assert [(a.part, a.end) for a in found] == [(0, 5), (1, ANCHOR_CHARS), (1, 2 * ANCHOR_CHARS), (1, len(content))]
    other_adapter = anchors(messages=[Message(role="system", content="short")], prompt=None, adapter="lora-a")
    assert other_adapter[0].key != found[0].key


async def test_batches_lost_at_the_end_of_a_burst_are_fetched_after_a_quiet_second() -> None:
    sim, index, events, gaps = await engine_and_index(drop_every=1)  # nothing is delivered live
    request = chat(document("a"), "q")
    await run(sim, request)
    follower = asyncio.create_task(index.follow(events))
    try:
        async with asyncio.timeout(5):
            while not set(request_anchors(request)[1:-2]) <= index.held_anchors():
                await asyncio.sleep(0.05)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
    assert gaps.healed == ["replay"]
