"""The prefix index against the real Redis: what a worker's KvIndex writes (from its engine's
events) is what session managers read (PrefixIndex.matches); a removal, a failed write healed by
a whole rewrite, a drain's withdrawal, the set's expiry; Redis away costs the router a fallback
within its timeout, never an error."""

import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis

from services.sessions.prefix_routing import PrefixRouter
from services.worker.engines.base import GenerationRequest
from services.worker.engines.kv_events import BlockRemoved, BlockStored, EventBatch, RenderedPrompt
from services.worker.kv_index import KvIndex
from shared.names import Names
from shared.prefix_index import PREFIX_INDEX_TTL_S, PrefixIndex, anchors
from shared.redis_pipe import RedisPipe
from shared.registry import LiveModel
from shared.schemas import Job, Message, Sampling

MODEL = "m"
BLOCK = 4


@pytest.fixture
async def pipe(service_urls) -> AsyncIterator[RedisPipe]:
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    yield pipe
    await pipe.aclose()


@pytest.fixture
def names(namespace: str) -> Names:
    return Names(f"{namespace}-prefix-{uuid.uuid4().hex[:6]}")


def prompt_of(text: str) -> tuple[GenerationRequest, RenderedPrompt]:
    """A completion prompt whose tokens are its characters (one id each, ending where they end)."""
    request = GenerationRequest(request_id="r", sampling=Sampling(), prompt=text)
    return request, RenderedPrompt(text, [ord(c) for c in text], list(range(1, len(text) + 1)))


def stored_batch(seq: int, text: str) -> EventBatch:
    """The engine storing every whole block of `text` (engine hashes `b0`, `b1`, …)."""
    blocks = len(text) // BLOCK
    tokens = [ord(c) for c in text[: blocks * BLOCK]]
    return EventBatch(seq, time.time(), [BlockStored([f"b{i}" for i in range(blocks)], None, tokens, BLOCK)])


def worker_index(pipe: RedisPipe, names: Names, worker: str) -> KvIndex:
    return KvIndex(pipe, names, model=MODEL, worker_id=worker, block_size=BLOCK, max_pending=1000)


def job_of(text: str) -> Job:
    return Job(job_id="j", model=MODEL, prompt=text, sampling=Sampling(), deadline=time.time() + 60, channel="c")


async def test_what_a_worker_writes_is_what_session_managers_read(
    pipe: RedisPipe, names: Names, redis_client: redis.Redis
) -> None:
    text = "x" * 1000  # anchors at 256, 512, 768 and 1000 characters
    keys = [a.key for a in anchors(messages=None, prompt=text)]
    index = worker_index(pipe, names, "w1")
    index.observe(*prompt_of(text))
    index.apply(stored_batch(0, text))
    await index.write()
    reader = PrefixIndex(pipe, names)
    assert await reader.matches(MODEL, keys, {"w1", "w2"}) == {"w1": 4, "w2": 0}
    ttl = await redis_client.ttl(names.prefix_index(MODEL, "w1"))
    assert PREFIX_INDEX_TTL_S - 5 <= ttl <= PREFIX_INDEX_TTL_S
    # The engine evicts the prompt's tail blocks: its last anchors go, its start stays.
    index.apply(EventBatch(1, time.time(), [BlockRemoved([f"b{i}" for i in range(150, 250)])]))
    await index.write()
    assert await reader.matches(MODEL, keys, {"w1"}) == {"w1": 2}
    await index.withdraw()
    assert not await redis_client.exists(names.prefix_index(MODEL, "w1"))


async def test_a_write_that_failed_is_made_good_by_a_whole_rewrite(
    pipe: RedisPipe, names: Names, redis_client: redis.Redis, service_urls
) -> None:
    text = "y" * 600
    keys = [a.key for a in anchors(messages=None, prompt=text)]
    away = RedisPipe("redis://127.0.0.1:1", timeout_s=0.5)
    index = worker_index(away, names, "w1")
    index.observe(*prompt_of(text))
    index.apply(stored_batch(0, text))
    await index.write()  # Redis away: nothing written, the set marked to be written whole
    await away.aclose()
    index._pipe = pipe
    # Meanwhile a stale member sits in the set (say, from before a restart of the index).
    await redis_client.sadd(names.prefix_index(MODEL, "w1"), b"stale-anchor")
    await index.write()
    members = await redis_client.smembers(names.prefix_index(MODEL, "w1"))
    assert b"stale-anchor" not in members
    assert set(keys) == members


async def test_a_set_redis_lost_is_written_whole_again(
    pipe: RedisPipe, names: Names, redis_client: redis.Redis
) -> None:
    text = "v" * 600
    index = worker_index(pipe, names, "w1")
    index.observe(*prompt_of(text))
    index.apply(stored_batch(0, text))
    await index.write()
    await redis_client.delete(names.prefix_index(MODEL, "w1"))  # Redis restarted empty
    index._last_write = 0.0  # the refresh is due
    await index.write()  # its EXPIRE finds no set
    await index.write()
    assert await redis_client.smembers(names.prefix_index(MODEL, "w1")) == {
        a.key for a in anchors(messages=None, prompt=text)
    }


async def test_redis_away_leaves_routing_to_todays_rules_within_the_timeout(names: Names) -> None:
    away = RedisPipe("redis://127.0.0.1:1", timeout_s=5)
    router = PrefixRouter(PrefixIndex(away, names), spill_seqs=2, lookup_timeout_s=0.05)
    live = LiveModel(2, 4096, homes=frozenset({"w1", "w2"}), indexed=frozenset({"w1", "w2"}))
    started = time.perf_counter()
    assert await router.route(job_of("z" * 2000), live, session_home=None) is None
    assert time.perf_counter() - started < 1.0
    await away.aclose()


async def test_only_live_indexed_workers_sets_are_read(pipe: RedisPipe, names: Names) -> None:
    text = "w" * 2000
    for worker in ("w1", "gone"):
        index = worker_index(pipe, names, worker)
        index.observe(*prompt_of(text))
        index.apply(stored_batch(0, text))
        await index.write()
    router = PrefixRouter(PrefixIndex(pipe, names), spill_seqs=2, lookup_timeout_s=1.0)
    # `gone` holds more of it than w1 might, but it is not live for this model: never chosen.
    live = LiveModel(2, 4096, homes=frozenset({"w1", "w2"}), indexed=frozenset({"w1", "w2"}))
    route = await router.route(job_of(text + " and a question"), live, session_home=None)
    assert route is not None and (route.home, route.reason) == ("w1", "cached_prefix")
    messages_job = job_of(text)
    messages_job.prompt, messages_job.messages = None, [Message(role="user", content="short")]
    assert await router.route(messages_job, live, session_home=None) is None  # too short to route on
