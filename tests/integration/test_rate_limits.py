"""What an admission holds, against the real Redis: a completion charged the most tokens it may
use against its key's tokens per minute and settled to its use whichever side settles first, a
concurrency refusal's Retry-After, and settlements that Redis could not take sent again once it
is back (issue 29)."""

import asyncio
import datetime as dt
import time
import uuid

import pytest

from shared.keys import KeyLimits
from shared.names import Names
from shared.ratelimit import _SETTLE, PERIOD_MS, Decision, RateLimiter, budget_window, refusal
from shared.redis_pipe import RedisPipe
from tests.e2e.tcpproxy import TcpProxy

PERIOD_ID = budget_window("day", dt.datetime.now(dt.UTC))[0]


@pytest.fixture
async def limiter(service_urls, namespace):
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    yield RateLimiter(pipe, Names(f"{namespace}-rl-{uuid.uuid4().hex[:6]}"))
    await pipe.aclose()


async def _admit(limiter: RateLimiter, key_id: str, limits: KeyLimits, tokens: int, *, ttl_s: float = 60) -> Decision:
    return await limiter.check(
        key_id, limits, tokens=tokens, lease_id=uuid.uuid4().hex[:16], lease_ttl_s=ttl_s, period_id=PERIOD_ID
    )


def _settle(limiter: RateLimiter, key_id: str, limits: KeyLimits, decision: Decision, used: int):
    return limiter.submit_settle(
        key_id,
        lease_id=decision.lease_id,
        tpm_limit=limits.tpm or 0,
        tpm_charged=decision.tpm_charged,
        budget=decision.reservation,
        used=used,
    )


async def test_a_completion_is_charged_its_most_and_settled_to_its_use(limiter) -> None:
    limits = KeyLimits(tpm=600)  # 100 ms a token
    first = await _admit(limiter, "k1", limits, 400)
    assert first.allowed and first.tpm_charged == 400 and first.lease_id is not None
    assert 199 <= first.tokens.remaining <= 200
    refused = await _admit(limiter, "k1", limits, 400)
    assert refused.denied == "tokens" and refused.lease_id is None and refused.tpm_charged == 0
    assert 19_000 <= refused.retry_after_ms <= 20_000  # 200 tokens to wait for, at 100 ms each
    assert (await _admit(limiter, "k1", limits, 601)).denied == "too_large"
    # It used 100 of its 400: 300 come back at once, and the next 400 fit.
    assert await _settle(limiter, "k1", limits, first, 100) == [-300, 0]
    assert (await _admit(limiter, "k1", limits, 400)).allowed
    # A call that may use nothing holds nothing on a key without a concurrency limit.
    listing = await _admit(limiter, "k1", KeyLimits(tpm=600), 0)
    assert listing.lease_id is None and listing.tpm_charged == 0


async def test_either_side_may_settle_first_and_the_use_counts_once(limiter) -> None:
    limits = KeyLimits(tpm=6000, token_budget=10_000, budget_period="day")
    # The gateway gives up first (its client left): all back; the session manager then charges the use.
    a = await _admit(limiter, "k2", limits, 300)
    assert await _settle(limiter, "k2", limits, a, 0) == [-300, -300]
    assert await _settle(limiter, "k2", limits, a, 120) == [120, 120]
    # The session manager settles first: the gateway's release after it changes nothing.
    b = await _admit(limiter, "k2", limits, 300)
    assert await _settle(limiter, "k2", limits, b, 80) == [-220, -220]
    assert await _settle(limiter, "k2", limits, b, 0) == [0, 0]
    assert (await _admit(limiter, "k2", limits, 1)).budget_used == 120 + 80 + 1


async def test_a_settlement_that_may_have_run_is_sent_again_only_while_it_is_held(limiter, redis_client) -> None:
    """What `_Unsettled` sends again after a dropped connection or a timeout (its command may have
    run): nothing happens unless the lease or the reservation is still there."""
    limits = KeyLimits(tpm=6000, max_concurrent=1, token_budget=10_000, budget_period="day")
    names = limiter._names
    decision = await _admit(limiter, "k3", limits, 300)
    assert decision.reservation is not None and decision.lease_id is not None
    keys = [names.rate_limit("conc", "k3"), names.rate_limit("tpm", "k3"), limiter._budget_key("k3", PERIOD_ID)]
    args = [decision.lease_id, 50, 6000, 300, decision.reservation.reservation_id, decision.reservation.expires_at]
    again = [*args, PERIOD_MS, 1]
    # It had not run: the retry settles it.
    assert await limiter._pipe.evalsha(_SETTLE, keys, again) == [-250, -250]
    # It had run: the retry does nothing (the use is not charged twice).
    assert await limiter._pipe.evalsha(_SETTLE, keys, again) == [0, 0]
    assert (await _admit(limiter, "k3", limits, 1)).budget_used == 50 + 1
    assert await redis_client.zcard(names.rate_limit("conc", "k3")) == 1  # that last admission's lease


async def test_a_concurrency_refusal_says_when_the_oldest_lease_expires(limiter) -> None:
    limits = KeyLimits(max_concurrent=2)
    held = [await _admit(limiter, "k4", limits, 0, ttl_s=30) for _ in range(2)]
    await asyncio.sleep(0.5)
    refused = await _admit(limiter, "k4", limits, 0, ttl_s=30)
    assert refused.denied == "concurrent"
    assert 28_000 <= refused.retry_after_ms <= 29_600
    error = refusal(refused)
    assert error.headers["Retry-After"] == str(-(-refused.retry_after_ms // 1000))
    assert "at the latest in" in error.message
    await _settle(limiter, "k4", limits, held[0], 0)
    assert (await _admit(limiter, "k4", limits, 0)).allowed


async def test_settlements_redis_did_not_take_are_sent_again_once_it_is_back(
    service_urls, namespace, redis_client
) -> None:
    proxy = TcpProxy.to(service_urls.redis)
    pipe = RedisPipe(proxy.proxied(service_urls.redis), timeout_s=1)
    names = Names(f"{namespace}-rl-{uuid.uuid4().hex[:6]}")
    limiter = RateLimiter(pipe, names)
    limits = KeyLimits(tpm=6000, max_concurrent=3, token_budget=10_000, budget_period="day")
    budget_key = limiter._budget_key("k5", PERIOD_ID)
    try:
        admitted = [await _admit(limiter, "k5", limits, 300) for _ in range(3)]
        proxy.cut()
        try:
            # Redis unreachable: each settlement is kept, not failed.
            assert await asyncio.gather(*(_settle(limiter, "k5", limits, d, 40) for d in admitted)) == [None] * 3
            await asyncio.sleep(1)
        finally:
            proxy.restore()
        restored = time.monotonic()
        while await redis_client.zcard(names.rate_limit("conc", "k5")):
            assert time.monotonic() - restored < 2, "the leases were not released after Redis came back"
            await asyncio.sleep(0.05)
        state = await redis_client.hgetall(budget_key)
        assert state == {b"used": b"120"}  # each reservation settled to the 40 tokens used, once
        assert (await _admit(limiter, "k5", limits, 300)).allowed
    finally:
        await pipe.aclose()
        proxy.close()
        await redis_client.delete(*(names.rate_limit(kind, "k5") for kind in ("rpm", "tpm", "conc")), budget_key)
