"""A key's token budget in the limiter's Lua scripts, against the real Redis: reservations at
admission, settlement to the real usage in either order, and no overspending beyond one
reservation however many admissions race (several pipes stand for several gateways)."""

import asyncio
import datetime as dt
import random
import uuid

import pytest

from shared.keys import KeyLimits
from shared.names import Names
from shared.ratelimit import BudgetReservation, RateLimiter, budget_refusal, budget_window, period_end
from shared.redis_pipe import RedisPipe

NOW = dt.datetime.now(dt.UTC)
PERIOD_ID = budget_window("day", NOW)[0]


@pytest.fixture
async def limiters(service_urls, namespace):
    """Three limiters on three connections of their own, as three gateways have."""
    names = Names(f"{namespace}-budget-{uuid.uuid4().hex[:6]}")
    pipes = [RedisPipe(service_urls.redis, timeout_s=5) for _ in range(3)]
    yield [RateLimiter(pipe, names) for pipe in pipes]
    for pipe in pipes:
        await pipe.aclose()


async def _admit(limiter: RateLimiter, key_id: str, limits: KeyLimits, reserve: int):
    return await limiter.check(
        key_id, limits, tokens=reserve, lease_id=uuid.uuid4().hex[:16], lease_ttl_s=60, period_id=PERIOD_ID
    )


async def _settle(limiter: RateLimiter, key_id: str, reservation: BudgetReservation, used: int) -> int:
    """Settle `reservation` to `used` tokens; returns the budget's correction."""
    _, correction = await limiter.submit_settle(
        key_id, lease_id=None, tpm_limit=0, tpm_charged=0, budget=reservation, used=used
    )
    return correction


async def test_a_reservation_counts_until_settled_to_the_real_usage(limiters) -> None:
    limiter = limiters[0]
    limits = KeyLimits(token_budget=100, budget_period="day")
    first = await _admit(limiter, "k", limits, 60)
    assert first.allowed and first.budget_used == 60 and first.reservation is not None
    assert first.reservation.tokens == 60 and first.reservation.period_id == PERIOD_ID
    # 60 of 100 reserved: still below the budget, so the next one is admitted (and goes over).
    second = await _admit(limiter, "k", limits, 60)
    assert second.allowed and second.budget_used == 120
    refused = await _admit(limiter, "k", limits, 1)
    assert refused.denied == "budget" and refused.budget_used == 120 and refused.reservation is None
    # The answers used 10 and 5 tokens: the budget has 85 left.
    assert await _settle(limiter, "k", first.reservation, 10) == -50
    assert await _settle(limiter, "k", second.reservation, 5) == -55
    again = await _admit(limiter, "k", limits, 1)
    assert again.allowed and again.budget_used == 16


async def test_settling_twice_or_after_the_gateways_release_charges_the_usage_once(limiters) -> None:
    limiter = limiters[0]
    limits = KeyLimits(token_budget=1000, budget_period="day")
    a = (await _admit(limiter, "k2", limits, 300)).reservation
    b = (await _admit(limiter, "k2", limits, 300)).reservation
    assert a is not None and b is not None
    # a: the session manager settles (40), then the gateway releases (a settlement of 0): no-op.
    await _settle(limiter, "k2", a, 40)
    assert await _settle(limiter, "k2", a, 0) == 0
    # b: the gateway gave up first (the reservation is given back), then the session manager
    # settles the 25 tokens the answer used.
    assert await _settle(limiter, "k2", b, 0) == -300
    assert await _settle(limiter, "k2", b, 25) == 25
    assert (await _admit(limiter, "k2", limits, 1)).budget_used == 40 + 25 + 1


async def test_calls_that_reserve_nothing_and_keys_without_a_budget_are_not_held_to_one(limiters) -> None:
    limiter = limiters[0]
    spent = KeyLimits(token_budget=10, budget_period="month")
    assert (await _admit(limiter, "k3", spent, 10)).allowed
    assert (await _admit(limiter, "k3", spent, 5)).denied == "budget"
    listing = await _admit(limiter, "k3", spent, 0)  # e.g. GET /v1/models
    assert listing.allowed and listing.reservation is None
    unlimited = await _admit(limiter, "k3", KeyLimits(), 10_000)
    assert unlimited.allowed and unlimited.reservation is None and unlimited.budget_used == 0


async def test_a_budget_refusal_stops_before_the_rate_limits_are_charged(limiters) -> None:
    limiter = limiters[0]
    limits = KeyLimits(token_budget=5, budget_period="day", rpm=2)
    assert (await _admit(limiter, "k4", limits, 5)).allowed  # one request of the two per minute
    for _ in range(3):
        assert (await _admit(limiter, "k4", limits, 1)).denied == "budget"
    # The refusals took no request from the minute: the second one is still there.
    assert (await _admit(limiter, "k4", KeyLimits(rpm=2), 0)).allowed


async def test_racing_admissions_on_three_gateways_overspend_by_at_most_one_reservation(limiters) -> None:
    budget, reserve = 5_000, 120
    limits = KeyLimits(token_budget=budget, budget_period="day")
    rng = random.Random(7)
    spent: list[int] = []

    async def request(i: int) -> bool:
        decision = await _admit(limiters[i % 3], "race", limits, reserve)
        if not decision.allowed:
            assert decision.denied == "budget"
            return False
        assert decision.reservation is not None
        await asyncio.sleep(rng.random() * 0.01)
        used = rng.randint(reserve // 2, reserve)  # an answer uses at most what it reserved
        spent.append(used)
        await _settle(limiters[(i + 1) % 3], "race", decision.reservation, used)
        return True

    # Waves of 100 concurrent requests until one wave is refused whole: the budget is spent.
    rounds = 0
    while any(await asyncio.gather(*(request(i) for i in range(100)))):
        rounds += 1
        assert sum(spent) <= budget + reserve, sum(spent)
    assert rounds > 1 and budget <= sum(spent) <= budget + reserve, (rounds, sum(spent))
    assert (await _admit(limiters[0], "race", limits, 1)).denied == "budget"


async def test_the_budget_state_expires_after_its_period_with_a_grace(limiters, redis_client) -> None:
    limiter = limiters[0]
    decision = await _admit(limiter, "k5", KeyLimits(token_budget=50, budget_period="day"), 10)
    assert decision.reservation is not None
    key = limiter._budget_key("k5", PERIOD_ID)
    expires = await redis_client.expiretime(key)
    assert expires == int(period_end(PERIOD_ID).timestamp()) + 2 * 86_400
    assert await redis_client.hget(key, f"r:{decision.reservation.reservation_id}") == b"10"


@pytest.mark.parametrize(
    ("period", "now", "period_id", "next_start"),
    [
        ("day", "2026-11-24T23:59:59+00:00", "d20261124", "2026-11-25T00:00:00+00:00"),
        ("day", "2026-11-24T23:30:00-05:00", "d20261125", "2026-11-26T00:00:00+00:00"),
        ("month", "2026-12-31T12:00:00+00:00", "m202612", "2027-01-01T00:00:00+00:00"),
        ("month", "2028-02-29T00:00:00+00:00", "m202802", "2028-03-01T00:00:00+00:00"),
    ],
)
def test_periods_are_utc_calendar_days_and_months(period, now, period_id, next_start) -> None:
    moment = dt.datetime.fromisoformat(now)
    assert budget_window(period, moment) == (period_id, dt.datetime.fromisoformat(next_start))
    assert period_end(period_id) == dt.datetime.fromisoformat(next_start)


def test_the_reservation_header_round_trips_and_refuses_garbage() -> None:
    reservation = BudgetReservation("m202611", "0123abcd", 4200)
    assert reservation.header() == "m202611:0123abcd:4200"
    assert BudgetReservation.parse(reservation.header()) == reservation
    for bad in ("", "m202611:0123abcd", "x202611:id:1", "m202611:id:-1", "m202611::1", "d2026112:id:1", "a:b:c:d"):
        with pytest.raises(ValueError):
            BudgetReservation.parse(bad)


def test_the_refusal_says_when_the_budget_renews() -> None:
    now = dt.datetime(2026, 11, 24, 23, 59, 0, 500_000, tzinfo=dt.UTC)
    error = budget_refusal(KeyLimits(token_budget=1000, budget_period="day"), 1003, now)
    assert error.status_code == 429 and error.code == "budget_exceeded"
    assert error.headers["Retry-After"] == "60"
    assert "1000 tokens per day" in error.message and "2026-11-25T00:00:00Z" in error.message
