"""A Redis blip leaks nothing a key is limited by (issue 29): a gateway and a session manager whose
Redis goes through a proxy the test cuts for 2 s, while three streams of a key with
`max_concurrent` 3 and a token budget run. Once Redis is back, the key's next requests succeed at
once, and no concurrency lease or token reservation of its is left in Redis.
"""

import asyncio
import time
from collections.abc import Iterator

import asyncpg
import httpx
import pytest
import redis.asyncio as aioredis

from services.cli.launcher import Service
from shared.keys import KeyLimits, KeyRepository
from shared.names import Names
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.load import report
from tests.e2e.stack import Stack
from tests.e2e.tcpproxy import TcpProxy
from tests.services import ServiceUrls

pytestmark = pytest.mark.e2e

LIMITS = KeyLimits(max_concurrent=3, tpm=1_000_000, token_budget=10_000_000, budget_period="day")
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def proxy(service_urls: ServiceUrls) -> Iterator[TcpProxy]:
    proxy = TcpProxy.to(service_urls.redis)
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def proxied(stack: Stack, sim_worker: Service, proxy: TcpProxy, service_urls: ServiceUrls) -> Iterator[Service]:
    """A session manager and a gateway (returned) whose Redis is behind `proxy`; the stack's sim
    worker (its Redis direct) answers their jobs."""
    env = {"AXON_REDIS_URL": proxy.proxied(service_urls.redis), "AXON_CONNECT_TIMEOUT_S": "1"}
    started = [stack.start("sessions:redis-blip", env=env)]
    try:
        started.append(stack.start("gateway:redis-blip", env={**env, "AXON_SESSIONS_URL": started[0].url}))
        yield started[1]
    finally:
        for service in reversed(started):
            service.stop(timeout_s=15)
            stack.services.remove(service)


async def _key(database_url: str) -> tuple[str, str]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    try:
        key, record = await KeyRepository(pool).create(name="redis-blip", limits=LIMITS)
        return key, record.id
    finally:
        await pool.close()


async def _held(redis: aioredis.Redis, names: Names, key_id: str) -> dict[str, object]:
    """What Redis holds for the key's requests in flight: its concurrency leases and the
    reservations of its token budget (and of its tokens per minute)."""
    held: dict[str, object] = {"leases": await redis.zcard(names.rate_limit("conc", key_id))}
    async for name in redis.scan_iter(match=names.rate_limit("budget", f"{key_id}:*")):
        held["budget reservations"] = [f.decode() for f in await redis.hkeys(name) if f.startswith(b"r:")]
    return held


def _nothing_held(held: dict[str, object]) -> bool:
    return held["leases"] == 0 and not held.get("budget reservations")


async def test_a_2s_redis_cut_during_streams_leaves_no_lease_or_reservation(
    proxied: Service, proxy: TcpProxy, stack: Stack, database_url: str, service_urls: ServiceUrls
) -> None:
    key, key_id = await _key(database_url)
    names = Names(stack.namespace)
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{proxied.url}/v1/chat/completions"
    redis = aioredis.from_url(service_urls.redis)
    async with httpx.AsyncClient(timeout=30) as client:

        async def stream(started: asyncio.Event) -> str:
            body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 1500, "stream": True}
            async with client.stream("POST", url, json=body, headers=headers) as response:
                assert response.status_code == 200, await response.aread()
                lines = []
                async for line in response.aiter_lines():
                    started.set()
                    lines.append(line)
                return "\n".join(lines)

        async def one() -> httpx.Response:
            body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 2}
            return await client.post(url, json=body, headers=headers)

        try:
            events = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(stream(e)) for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=20)
            assert (await _held(redis, names, key_id))["leases"] == 3
            # A fourth is refused until the oldest lease expires at the latest (AXON_CONCURRENCY_LEASE_S).
            fourth = await one()
            assert fourth.status_code == 429, fourth.text
            assert 300 <= int(fourth.headers["retry-after"]) <= 360
            proxy.cut()
            try:
                await asyncio.sleep(2)
            finally:
                proxy.restore()
            restored = time.monotonic()
            ended = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
            await asyncio.sleep(max(0.0, restored + 0.5 - time.monotonic()))
            held_then = await _held(redis, names, key_id)
            # The key's three slots are free again: three requests at once all succeed.
            answers = await asyncio.gather(*(one() for _ in range(3)))
            statuses = [a.status_code for a in answers]
            settled_s = None
            while time.monotonic() - restored < 10:
                held = await _held(redis, names, key_id)
                if _nothing_held(held):
                    settled_s = time.monotonic() - restored
                    break
                await asyncio.sleep(0.05)
        finally:
            await redis.aclose()
    report(
        "redis cut 2 s under 3 streams of a key with max_concurrent 3",
        retry_after_before_the_cut=fourth.headers["retry-after"],
        streams_interrupted=sum("stream_interrupted" in text for text in ended),
        held_0_5_s_after_redis_returned=held_then,
        three_requests_then=statuses,
        nothing_held_after_they_ended_s=round(settled_s, 2) if settled_s is not None else None,
        held_at_end=held,
    )
    assert statuses == [200, 200, 200], [a.text for a in answers]
    assert settled_s is not None, held
