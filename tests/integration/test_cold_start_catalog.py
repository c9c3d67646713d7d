"""services.sessions.catalog against the real Redis: how long a request for a model with no live
worker may wait for one (scale to zero), and what it assumes of the model meanwhile."""

import uuid

import pytest

from services.sessions.catalog import UNSEEN_MODEL, ModelCatalog
from shared.errors import ModelNotFound, Unavailable
from shared.names import Names
from shared.registry import WorkerRegistry


async def test_a_model_with_no_live_worker_waits_with_its_last_seen_profile(redis_client, namespace) -> None:
    names = Names(f"{namespace}-cold-{uuid.uuid4().hex[:6]}")
    registry = WorkerRegistry(redis_client, names)
    waits = {"pool": 60.0, "fresh": 30.0, "zero": 0.0}
    catalog = ModelCatalog(registry, cache_ttl_s=0, cold_start_waits=waits)
    try:
        await registry.heartbeat(
            worker_id="w1", model="pool", ttl_s=30, max_seqs=4, context_tokens=8192, supports={"seed", "stop"}
        )
        await registry.heartbeat(
            worker_id="w2", model="pool", ttl_s=30, max_seqs=4, context_tokens=4096, supports={"seed"}
        )
        model, live, wait_s = await catalog.require_or_wait("pool")
        assert (model, live.workers, wait_s) == ("pool", 2, 0.0)

        await registry.remove("w1")
        await registry.remove("w2")
        model, cold, wait_s = await catalog.require_or_wait("pool")
        assert (model, wait_s) == ("pool", 60.0)
        assert (cold.workers, cold.context_tokens, cold.supports, cold.homes) == (0, 4096, {"seed"}, frozenset())

        # Another session manager, whose default wait is 0, reads the same profile from Redis.
        other = ModelCatalog(registry, cache_ttl_s=0)
        with pytest.raises(Unavailable) as refused:
            await other.require_or_wait("pool")
        assert (refused.value.code, refused.value.retry_after_s) == ("no_worker", 5)
        _, cold, wait_s = await other.require_or_wait("pool", wait_s=600)
        assert (cold.context_tokens, wait_s) == (4096, 600)

        # An alias resolves to its model; the wait is the model's.
        await redis_client.hset(names.aliases_key, "prod", "pool")
        assert (await catalog.require_or_wait("prod"))[0::2] == ("pool", 60.0)

        # Listed but never seen live: known, nothing assumed of it. Listed with 0: known, refused.
        assert await catalog.require_or_wait("fresh") == ("fresh", UNSEEN_MODEL, 30.0)
        with pytest.raises(Unavailable) as refused:
            await catalog.require_or_wait("zero")
        assert refused.value.code == "no_worker"
        with pytest.raises(ModelNotFound):
            await catalog.require_or_wait("nope", wait_s=600)

        # A profile that changes is remembered again.
        await registry.heartbeat(worker_id="w3", model="pool", ttl_s=30, max_seqs=4, context_tokens=2048)
        await catalog.require_or_wait("pool")
        await registry.remove("w3")
        _, cold, _ = await catalog.require_or_wait("pool")
        assert (cold.context_tokens, cold.supports) == (2048, frozenset())
    finally:
        await redis_client.delete(names.workers_key, names.models_key, names.aliases_key, names.model_profiles_key)


async def test_an_adapter_with_no_live_worker_waits_in_its_base_models_queue(redis_client, namespace) -> None:
    names = Names(f"{namespace}-cold-{uuid.uuid4().hex[:6]}")
    registry = WorkerRegistry(redis_client, names)
    catalog = ModelCatalog(registry, cache_ttl_s=0, cold_start_wait_s=30)
    try:
        await registry.heartbeat(
            worker_id="w1", model="base", ttl_s=30, max_seqs=4, context_tokens=4096, adapters=["tuned"]
        )
        assert (await catalog.require_or_wait("tuned"))[1].route("tuned") == ("base", "tuned")
        await registry.remove("w1")
        _, cold, wait_s = await catalog.require_or_wait("tuned")
        assert (cold.route("tuned"), cold.context_tokens, wait_s) == (("base", "tuned"), 4096, 30)

        # An adapter some worker announced but no session manager saw live: its base from the registry.
        await redis_client.hset(names.adapters_key, "other", "base")
        _, cold, _ = await catalog.require_or_wait("other")
        assert cold.route("other") == ("base", "other") and cold.supports == UNSEEN_MODEL.supports

        # An adapter of a pool at zero that no worker ever announced: its base from the settings
        # (the chart's AXON_COLD_START_ADAPTERS), so its job wakes that pool.
        configured = ModelCatalog(
            registry, cache_ttl_s=0, cold_start_waits={"fresh": 60}, cold_start_adapters={"fresh": "base"}
        )
        _, cold, wait_s = await configured.require_or_wait("fresh")
        assert (cold.route("fresh"), wait_s) == (("base", "fresh"), 60)
    finally:
        await redis_client.delete(names.workers_key, names.models_key, names.adapters_key, names.model_profiles_key)
