"""The fair share's Redis side (`shared/fair.py`) on the real Redis: admission by share, the lift of a
newly active tenant, the pick of the least served, weights, and the meter's settlement."""

import asyncio
import uuid

import pytest

from shared.fair import BATCH, INTERACTIVE, FairShare, ServiceMeter
from shared.names import Names
from shared.redis_pipe import RedisPipe

MODEL = "m"


@pytest.fixture
async def fair(namespace, service_urls):
    names = Names(f"{namespace}-fair-{uuid.uuid4().hex[:6]}")
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    yield FairShare(pipe, names), pipe, names
    keys = await pipe.execute("KEYS", f"{names.namespace}:*")
    if keys:
        await pipe.execute("DEL", *keys)
    await pipe.aclose()


async def served(fair: FairShare, band=INTERACTIVE) -> dict[str, float]:
    return (await fair.state(MODEL, band=band)).served


async def test_a_lone_tenant_may_fill_the_queue_and_shares_split_it_by_weight(fair) -> None:
    share, pipe, names = fair
    alone = await share.admit(MODEL, "a", band=INTERACTIVE, limit=10)
    assert (alone.within_share, alone.idle, alone.allowance) == (True, True, 10)
    for _ in range(6):
        await share.enqueued(MODEL, "a", band=INTERACTIVE)
    # b arrives: the queue is split 1:1; a's 6 waiting are past its 5.
    b = await share.admit(MODEL, "b", band=INTERACTIVE, limit=10)
    assert (b.within_share, b.idle, b.allowance) == (True, False, 5)
    await share.enqueued(MODEL, "b", band=INTERACTIVE)
    assert not (await share.admit(MODEL, "a", band=INTERACTIVE, limit=10)).within_share
    # b weighs 3: a's share is a quarter.
    await pipe.execute("HSET", names.tenant_weights, "b", "3")
    assert (await share.admit(MODEL, "b", band=INTERACTIVE, limit=10)).allowance == 7
    assert (await share.admit(MODEL, "a", band=INTERACTIVE, limit=10)).allowance == 2
    # A weight that is not a positive number counts as 1.
    await pipe.execute("HSET", names.tenant_weights, "b", "-2")
    assert (await share.admit(MODEL, "b", band=INTERACTIVE, limit=10)).allowance == 5


async def test_the_least_served_waiting_tenant_is_picked_and_counted_down(fair) -> None:
    share, _pipe, _names = fair
    assert await share.claim(MODEL, band=INTERACTIVE) is None
    for tenant in ("a", "a", "b"):
        await share.enqueued(MODEL, tenant, band=INTERACTIVE)
    share.settle(MODEL, INTERACTIVE, {"a": 10.0})
    await share.settle(MODEL, INTERACTIVE, {"b": 4.0})
    assert await share.claim(MODEL, band=INTERACTIVE) == "b"
    assert await share.claim(MODEL, band=INTERACTIVE) == "a"
    assert await share.claim(MODEL, band=INTERACTIVE) == "a"
    assert await share.claim(MODEL, band=INTERACTIVE) is None
    assert (await share.state(MODEL, band=INTERACTIVE)).waiting == {}


async def test_a_newly_active_tenant_starts_at_the_least_counter_of_those_waiting(fair) -> None:
    share, _pipe, _names = fair
    await share.enqueued(MODEL, "busy", band=INTERACTIVE)
    await share.enqueued(MODEL, "busier", band=INTERACTIVE)
    await share.settle(MODEL, INTERACTIVE, {"busy": 500.0, "busier": 900.0})
    # Idle until now: no credit for it, it starts level with the least of those waiting.
    await share.enqueued(MODEL, "idle", band=INTERACTIVE)
    assert (await served(share))["idle"] == 500.0
    # One already ahead keeps its own counter.
    await share.settle(MODEL, INTERACTIVE, {"ahead": 2000.0})
    await share.enqueued(MODEL, "ahead", band=INTERACTIVE)
    assert (await served(share))["ahead"] == 2000.0


async def test_with_none_waiting_a_new_tenant_starts_at_the_last_pick(fair) -> None:
    share, _pipe, _names = fair
    await share.enqueued(MODEL, "a", band=INTERACTIVE)
    await share.settle(MODEL, INTERACTIVE, {"a": 300.0})
    assert await share.claim(MODEL, band=INTERACTIVE) == "a"
    await share.enqueued(MODEL, "late", band=INTERACTIVE)
    assert (await served(share))["late"] == 300.0


async def test_a_tenant_back_from_idle_is_lifted_too_when_its_job_takes_a_free_sequence(fair) -> None:
    """A job that goes straight to a free sequence (nothing waits) lifts its idle tenant as a
    waiting one would: a tenant served that way without the lift kept its old counter, and one
    arriving a moment later was lifted to the last pick's, far above it, and waited behind it."""
    share, _pipe, _names = fair
    await share.enqueued(MODEL, "earlier", band=INTERACTIVE)
    await share.settle(MODEL, INTERACTIVE, {"earlier": 300.0})
    assert await share.claim(MODEL, band=INTERACTIVE) == "earlier"  # the last pick: 300
    await share.report_free(MODEL, "w", 1, valid_ms=3000)
    assert (await share.admit(MODEL, "direct", band=INTERACTIVE, limit=10)).reserved
    await share.settle(MODEL, INTERACTIVE, {"direct": 10.0})
    await share.enqueued(MODEL, "late", band=INTERACTIVE)  # nothing waits: lifted to the last pick
    await share.enqueued(MODEL, "direct", band=INTERACTIVE)  # served a moment ago: its own counter
    assert await served(share) == {"earlier": 300.0, "direct": 310.0, "late": 300.0}
    assert await share.claim(MODEL, band=INTERACTIVE) == "late"


async def test_served_tokens_are_divided_by_the_weight_and_bands_count_apart(fair) -> None:
    share, pipe, names = fair
    await pipe.execute("HSET", names.tenant_weights, "heavy", "4")
    meter = ServiceMeter(share, prompt_cost=1.0, output_cost=2.0)
    meter.prompt(MODEL, INTERACTIVE, "heavy", 20)
    meter.output(MODEL, INTERACTIVE, "heavy", 10)
    meter.output(MODEL, INTERACTIVE, "light", 10)
    meter.output(MODEL, BATCH, "light", 5)
    await meter.flush()
    assert await served(share) == {"heavy": 10.0, "light": 20.0}
    assert await served(share, BATCH) == {"light": 10.0}
    meter.prompt(MODEL, INTERACTIVE, "light", -4)  # an estimate corrected
    await meter.flush()
    assert (await served(share))["light"] == 16.0


async def test_picks_follow_weighted_service_so_backlogged_tenants_share_by_weight(fair) -> None:
    share, pipe, names = fair
    await pipe.execute("HSET", names.tenant_weights, "three", "3")
    for _ in range(400):
        await share.enqueued(MODEL, "one", band=INTERACTIVE)
        await share.enqueued(MODEL, "three", band=INTERACTIVE)
    tokens = {"one": 0, "three": 0}
    for _ in range(400):  # each pick is served 10 tokens at once
        tenant = await share.claim(MODEL, band=INTERACTIVE)
        assert tenant is not None
        tokens[tenant] += 10
        await share.settle(MODEL, INTERACTIVE, {tenant: 10.0})
    assert tokens["three"] / sum(tokens.values()) == pytest.approx(0.75, abs=0.01)


async def test_every_key_expires(fair) -> None:
    share, pipe, names = fair
    await share.enqueued(MODEL, "a", band=INTERACTIVE)
    await share.settle(MODEL, INTERACTIVE, {"a": 1.0})
    await share.claim(MODEL, band=INTERACTIVE)
    await share.enqueued(MODEL, "a", band=INTERACTIVE)
    for key in await pipe.execute("KEYS", f"{names.namespace}:fair:*"):
        assert await pipe.execute("TTL", key) > 0, key


async def test_a_tenant_served_a_moment_ago_keeps_its_deficit(fair) -> None:
    share, _pipe, _names = fair
    await share.enqueued(MODEL, "ahead", band=INTERACTIVE)
    await share.settle(MODEL, INTERACTIVE, {"ahead": 800.0, "behind": 100.0})
    # "behind" was served just now (its clients send the next request as an answer ends): it is
    # not idle, so nothing waiting for a moment does not lift it to the others' counters.
    await share.enqueued(MODEL, "behind", band=INTERACTIVE)
    assert (await served(share))["behind"] == 100.0
    assert await share.claim(MODEL, band=INTERACTIVE) == "behind"


async def test_while_nothing_waits_an_interactive_job_reserves_a_reported_free_sequence(fair) -> None:
    share, _pipe, _names = fair
    share.report_free(MODEL, "w1", 1, valid_ms=3000)
    await share.report_free(MODEL, "w2", 2, valid_ms=3000)
    # Batch lines never go straight to a sequence: they wait for the sequences nobody wants.
    assert not (await share.admit(MODEL, "a", band=BATCH, limit=10)).reserved
    reserved = [(await share.admit(MODEL, "a", band=INTERACTIVE, limit=10)).reserved for _ in range(4)]
    assert reserved == [True, True, True, False]  # the three free sequences, most free worker first
    await share.report_free(MODEL, "w1", 1, valid_ms=3000)
    await share.enqueued(MODEL, "b", band=INTERACTIVE)  # now something waits: it goes first
    assert not (await share.admit(MODEL, "a", band=INTERACTIVE, limit=10)).reserved
    await share.claim(MODEL, band=INTERACTIVE)
    await share.withdraw(MODEL, "w1")  # draining
    assert not (await share.admit(MODEL, "a", band=INTERACTIVE, limit=10)).reserved


async def test_a_free_sequence_reported_long_ago_is_not_counted(fair) -> None:
    share, _pipe, _names = fair
    await share.report_free(MODEL, "dead", 8, valid_ms=1)
    await asyncio.sleep(0.01)
    assert not (await share.admit(MODEL, "a", band=INTERACTIVE, limit=10)).reserved


async def test_a_headroom_pick_never_takes_a_tenant_out_of_turn(fair) -> None:
    share, _pipe, _names = fair
    for tenant in ("busy", "quiet"):
        await share.enqueued(MODEL, tenant, band=INTERACTIVE)
    await share.settle(MODEL, INTERACTIVE, {"busy": 10.0, "quiet": 50.0})
    # "busy" runs on the worker and is the least served: nobody else may take the headroom.
    assert await share.claim(MODEL, band=INTERACTIVE, excluded=["busy"], least_only=True) is None
    await share.settle(MODEL, INTERACTIVE, {"busy": 100.0})
    assert await share.claim(MODEL, band=INTERACTIVE, excluded=["busy"], least_only=True) == "quiet"
