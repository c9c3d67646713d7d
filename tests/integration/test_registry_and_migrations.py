"""Worker registry against the real Redis; migrations against the real PostgreSQL."""

import asyncio
import uuid
from collections.abc import Awaitable

import asyncpg

from shared.migrations import drop_database, migrate
from shared.names import Names
from shared.registry import LiveModel, WorkerRegistry
from tests.waiting import until


async def _equal(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


async def test_heartbeat_makes_a_model_live_until_it_expires(redis_client, namespace) -> None:
    names = Names(f"{namespace}-reg-{uuid.uuid4().hex[:6]}")
    registry = WorkerRegistry(redis_client, names)
    assert await registry.live_models() == {}
    assert not await registry.is_known("m")
    await registry.heartbeat(worker_id="w1", model="m", ttl_s=0.5, max_seqs=4, context_tokens=4096)
    await registry.heartbeat(worker_id="w2", model="m", ttl_s=5, max_seqs=4, context_tokens=8192)
    assert await registry.live_models() == {
        "m": LiveModel(workers=2, context_tokens=4096, homes=frozenset({"w1", "w2"}))
    }
    one_left = {"m": LiveModel(workers=1, context_tokens=8192, homes=frozenset({"w2"}))}
    await until(lambda: _equal(registry.live_models(), one_left), timeout_s=5, what="w1's heartbeat expired")
    # A draining worker still serves its model, but is no session's home any more.
    await registry.heartbeat(worker_id="w2", model="m", ttl_s=5, max_seqs=4, context_tokens=8192, draining=True)
    assert await registry.live_models() == {"m": LiveModel(workers=1, context_tokens=8192)}
    await registry.remove("w2")
    assert await registry.live_models() == {}
    assert await registry.is_known("m")  # once served, a model stays known (503, not 404)
    await redis_client.delete(names.workers_key, names.models_key)


async def test_workers_that_keep_a_prefix_index_are_listed_while_they_are_homes(redis_client, namespace) -> None:
    names = Names(f"{namespace}-idx-{uuid.uuid4().hex[:6]}")
    registry = WorkerRegistry(redis_client, names)
    await registry.heartbeat(worker_id="w1", model="m", ttl_s=5, max_seqs=4, context_tokens=4096, prefix_index=True)
    await registry.heartbeat(worker_id="w2", model="m", ttl_s=5, max_seqs=4, context_tokens=4096)
    live = (await registry.live_models())["m"]
    assert (live.homes, live.indexed) == (frozenset({"w1", "w2"}), frozenset({"w1"}))
    # A draining worker's set is no longer read.
    await registry.heartbeat(
        worker_id="w1", model="m", ttl_s=5, max_seqs=4, context_tokens=4096, prefix_index=True, draining=True
    )
    assert (await registry.live_models())["m"].indexed == frozenset()
    await redis_client.delete(names.workers_key, names.models_key, names.models_seen_key)


async def test_dead_workers_and_models_no_live_worker_served_for_long_leave_the_registry(
    redis_client, namespace, monkeypatch
) -> None:
    monkeypatch.setattr("shared.registry._SWEEP_GRACE_S", 0.2)
    names = Names(f"{namespace}-reg-{uuid.uuid4().hex[:6]}")
    registry = WorkerRegistry(redis_client, names, forget_model_after_s=1.0)
    beat = {"max_seqs": 4, "context_tokens": 4096}
    await registry.heartbeat(worker_id="gone", model="old", ttl_s=0.2, adapters=["old-lora"], **beat)
    await registry.remember_profiles(await registry.live_models())
    await redis_client.sadd(names.models_key, "legacy")  # remembered before last-served times were kept
    await registry.heartbeat(worker_id="live", model="new", ttl_s=30, **beat)

    # The dead worker's entry is swept by the next reader once it expired (and a grace passed); its
    # models stay known for a while.
    async def swept() -> bool:
        live = await registry.live_models()
        return live == {"new": LiveModel(1, 4096, homes=frozenset({"live"}))} and set(
            await redis_client.hkeys(names.workers_key)
        ) == {b"live"}

    await until(swept, timeout_s=5, what="the dead worker swept")
    assert all([await registry.is_known(m) for m in ("old", "old-lora", "legacy", "new")])
    assert await registry.profile("old") is not None and await registry.adapter_base("old-lora") == "old"

    async def forgotten() -> bool:
        await registry.heartbeat(worker_id="live", model="new", ttl_s=30, **beat)
        return [await registry.is_known(m) for m in ("old", "old-lora", "legacy", "new")] == [False, False, False, True]

    await until(forgotten, timeout_s=5, what="the models not served for forget_model_after_s forgotten")
    assert await registry.profile("old") is None and await registry.adapter_base("old-lora") is None
    assert await redis_client.zrange(names.models_seen_key, 0, -1) == [b"new"]
    await redis_client.delete(
        names.workers_key, names.models_key, names.models_seen_key, names.adapters_key, names.model_profiles_key
    )


async def test_migrations_are_idempotent_and_safe_to_run_concurrently(run_id, service_urls) -> None:
    url = service_urls.postgres.rsplit("/", 1)[0] + f"/axon_test_{run_id}_mig"
    try:
        results = await asyncio.gather(migrate(url), migrate(url))
        applied = sorted(results, key=len)
        assert applied[0] == [] and applied[1][0] == "0001_initial"
        assert await migrate(url) == []
        conn = await asyncpg.connect(url)
        tables = {
            r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        }
        await conn.close()
        assert {"api_keys", "conversations", "messages", "usage", "schema_migrations"} <= tables
    finally:
        await drop_database(url)
