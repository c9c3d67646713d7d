"""Tenants' weights against the real PostgreSQL and Redis: set (PostgreSQL, then Redis), listed with
the tenants of API keys, and the gateways' sync repairing the Redis hash."""

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
import redis.asyncio as redis

from shared.keys import KeyLimits, KeyRepository
from shared.names import Names
from shared.tenants import TenantStore, keep_weights_synced, sync_weights


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    yield pool
    await pool.close()


@pytest.fixture
def names(namespace: str) -> Names:
    """A namespace of the test's own: the sync writes every tenant of the run's database."""
    return Names(f"{namespace}_{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def weights(redis_client: redis.Redis, names: Names) -> AsyncIterator[str]:
    yield names.tenant_weights
    await redis_client.delete(names.tenant_weights)


def _tenant(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


async def test_a_weight_is_stored_then_written_to_redis_and_set_again_in_place(
    pool: asyncpg.Pool, redis_client: redis.Redis, names: Names, weights: str
) -> None:
    store = TenantStore(pool, redis_client, names)
    tenant = _tenant("acme")
    stored, in_redis = await store.set_weight(tenant, 3.0)
    assert in_redis and (stored.tenant, stored.weight, stored.keys) == (tenant, 3.0, 0)
    assert await redis_client.hget(weights, tenant) == b"3"
    again, _ = await store.set_weight(tenant, 0.5)
    assert again.weight == 0.5 and await redis_client.hget(weights, tenant) == b"0.5"
    one, _ = await store.set_weight(tenant, 1.0)  # the default, kept as a row
    assert one.weight == 1.0 and await redis_client.hget(weights, tenant) == b"1"
    rows = await pool.fetch("SELECT weight FROM tenants WHERE tenant = $1", tenant)
    assert [r["weight"] for r in rows] == [1.0]


async def test_the_list_joins_the_tenants_of_keys_with_the_weighted_ones(
    pool: asyncpg.Pool, redis_client: redis.Redis, names: Names, weights: str
) -> None:
    store = TenantStore(pool, redis_client, names)
    keys = KeyRepository(pool)
    with_keys, weighted_only, revoked_only = _tenant("keys"), _tenant("weighted"), _tenant("revoked")
    for _ in range(2):
        await keys.create(name="t", limits=KeyLimits(), tenant=with_keys)
    expired_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    await keys.create(name="t", limits=KeyLimits(), tenant=with_keys, expires_at=expired_at)
    _, revoked = await keys.create(name="t", limits=KeyLimits(), tenant=revoked_only)
    await keys.revoke(revoked.id)
    _, own = await keys.create(name="t", limits=KeyLimits())  # its own id is its tenant
    await store.set_weight(weighted_only, 2.5)
    set_with_keys, _ = await store.set_weight(with_keys, 4.0)
    assert set_with_keys.keys == 2  # the expired key is not counted

    listed = {t.tenant: (t.weight, t.keys) for t in await store.list()}
    assert listed[with_keys] == (4.0, 2)
    assert listed[weighted_only] == (2.5, 0)
    assert listed[revoked_only] == (1.0, 0)
    assert listed[own.id] == (1.0, 1)
    assert list(listed) == sorted(listed)


async def test_sync_restores_a_lost_hash_and_removes_tenants_gone_from_the_table(
    pool: asyncpg.Pool, redis_client: redis.Redis, names: Names, weights: str
) -> None:
    store = TenantStore(pool, redis_client, names)
    kept, removed = _tenant("kept"), _tenant("removed")
    await store.set_weight(kept, 7.0)
    await store.set_weight(removed, 0.25)
    await redis_client.delete(weights)  # Redis restarted without its data

    assert await sync_weights(pool, redis_client, names) >= 2
    assert await redis_client.hget(weights, kept) == b"7"
    assert await redis_client.hget(weights, removed) == b"0.25"
    assert await sync_weights(pool, redis_client, names) == 0  # nothing differs: nothing written

    await pool.execute("DELETE FROM tenants WHERE tenant = $1", removed)
    await redis_client.hset(weights, kept, "99")  # a stale weight
    assert await sync_weights(pool, redis_client, names) == 2
    assert await redis_client.hget(weights, removed) is None
    assert await redis_client.hget(weights, kept) == b"7"


async def test_the_sync_loop_writes_at_start_and_again_each_interval(
    pool: asyncpg.Pool, redis_client: redis.Redis, names: Names, weights: str
) -> None:
    tenant = _tenant("loop")
    await pool.execute("INSERT INTO tenants (tenant, weight) VALUES ($1, 6)", tenant)  # set while Redis was away
    syncing = asyncio.create_task(keep_weights_synced(pool, redis_client, names, interval_s=0.2))
    try:
        await _until(lambda: redis_client.hget(weights, tenant), b"6")
        await redis_client.delete(weights)
        await _until(lambda: redis_client.hget(weights, tenant), b"6")
    finally:
        syncing.cancel()
        await asyncio.gather(syncing, return_exceptions=True)


async def _until(read, expected: bytes, timeout_s: float = 3.0) -> None:
    async with asyncio.timeout(timeout_s):
        while await read() != expected:
            await asyncio.sleep(0.05)
