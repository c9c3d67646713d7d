"""services.sessions.catalog against the real Redis: `/v1/models` entries and `/v1/models/{id}`
from worker heartbeats (context length, what every live worker supports, LoRA adapters) and aliases."""

import uuid

import pytest

from services.sessions import catalog as catalog_module
from services.sessions.catalog import ModelCatalog
from shared.errors import ModelNotFound, Unavailable
from shared.names import Names
from shared.registry import WorkerRegistry
from tests.waiting import until


async def test_entries_carry_context_length_and_the_capabilities_all_workers_share(redis_client, namespace) -> None:
    names = Names(f"{namespace}-cat-{uuid.uuid4().hex[:6]}")
    registry = WorkerRegistry(redis_client, names)
    catalog = ModelCatalog(registry, cache_ttl_s=0)
    try:
        await registry.heartbeat(
            worker_id="w1",
            model="m",
            ttl_s=30,
            max_seqs=4,
            context_tokens=8192,
            supports={"tools", "seed", "stop"},
            engine="vllm",
        )
        await registry.heartbeat(
            worker_id="w2",
            model="m",
            ttl_s=30,
            max_seqs=4,
            context_tokens=4096,
            supports={"seed", "stop", "echo"},
            engine="transformers",
        )
        await registry.heartbeat(worker_id="w3", model="other", ttl_s=30, max_seqs=4, context_tokens=2048)
        await registry.set_alias("prod", "m")
        await redis_client.hset(names.aliases_key, "dangling", "gone")

        entry = {
            "id": "m",
            "object": "model",
            "created": 0,
            "owned_by": "axon",
            "root": "m",
            "parent": None,
            "context_length": 4096,
            "capabilities": ["seed", "stop"],
            "engines": ["transformers", "vllm"],
        }
        assert await catalog.entry("m") == entry
        assert await catalog.entry("prod") == {**entry, "id": "prod"}
        assert await catalog.listing() == [
            entry,
            {**entry, "id": "other", "root": "other", "context_length": 2048, "capabilities": [], "engines": []},
            {**entry, "id": "prod"},
        ]
        for unknown in ("nope", "dangling"):
            with pytest.raises(ModelNotFound) as info:
                await catalog.entry(unknown)
            assert info.value.status_code == 404 and info.value.code == "model_not_found"
    finally:
        await redis_client.delete(names.workers_key, names.models_key, names.aliases_key)


async def test_adapters_are_models_of_their_own_routed_to_their_base_models_queue(redis_client, namespace) -> None:
    names = Names(f"{namespace}-cat-{uuid.uuid4().hex[:6]}")
    registry = WorkerRegistry(redis_client, names)
    catalog = ModelCatalog(registry, cache_ttl_s=0)
    try:
        for worker_id, context in (("w1", 8192), ("w2", 4096)):
            await registry.heartbeat(
                worker_id=worker_id,
                model="base",
                ttl_s=0.5,
                max_seqs=4,
                context_tokens=context,
                supports={"seed"},
                adapters=["sql", "fr"],
                engine="vllm",
            )
        await registry.set_alias("sql-prod", "sql")

        listed = {entry["id"]: entry for entry in await catalog.listing()}
        assert sorted(listed) == ["base", "fr", "sql", "sql-prod"]
        assert listed["base"]["parent"] is None
        assert listed["sql"] == {
            "id": "sql",
            "object": "model",
            "created": 0,
            "owned_by": "axon",
            "root": "sql",
            "parent": "base",
            "context_length": 4096,
            "capabilities": ["seed"],
            "engines": ["vllm"],
        }
        assert listed["sql-prod"] == {**listed["sql"], "id": "sql-prod"}

        model, live = await catalog.require("sql-prod")
        assert model == "sql" and live.workers == 2 and live.homes == {"w1", "w2"}
        assert live.route(model) == ("base", "sql")  # the base model's queue, the job naming the adapter
        base, base_live = await catalog.require("base")
        assert base_live.route(base) == ("base", None)

        with pytest.raises(ModelNotFound) as unknown:
            await catalog.require("sql-v2")
        assert unknown.value.code == "model_not_found"

        async def unavailable() -> Unavailable | None:
            try:
                await catalog.require("sql")
            except Unavailable as exc:
                return exc
            return None

        # Once every worker's heartbeat expired, a known adapter is unavailable, not unknown.
        gone = await until(unavailable, timeout_s=5, what="every worker's heartbeat expired")
        assert gone.code == "no_worker"
    finally:
        await redis_client.delete(names.workers_key, names.models_key, names.adapters_key, names.aliases_key)


async def test_a_sessions_home_newer_than_the_cached_view_is_read_again(
    redis_client, namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = Names(f"{namespace}-cat-{uuid.uuid4().hex[:6]}")
    registry = WorkerRegistry(redis_client, names)
    catalog = ModelCatalog(registry, cache_ttl_s=60)
    try:
        await registry.heartbeat(worker_id="w1", model="m", ttl_s=30, max_seqs=4, context_tokens=2048)
        _, live = await catalog.require("m")
        assert live.homes == {"w1"}
        await registry.heartbeat(worker_id="w2", model="m", ttl_s=30, max_seqs=4, context_tokens=2048)
        # A view younger than the recheck age is trusted: turns of sessions whose home died do not
        # each read the registry.
        monkeypatch.setattr(catalog_module, "RECHECK_HOME_AFTER_S", 60.0)
        assert (await catalog.with_home("m", live, "w2")).homes == {"w1"}
        monkeypatch.setattr(catalog_module, "RECHECK_HOME_AFTER_S", 0.0)
        assert (await catalog.with_home("m", live, "w2")).homes == {"w1", "w2"}
        # The cache holds the new view; a home that is gone is still missing from it.
        assert (await catalog.require("m"))[1].homes == {"w1", "w2"}
        assert (await catalog.with_home("m", live, "gone")).homes == {"w1", "w2"}
    finally:
        await redis_client.delete(names.workers_key, names.models_key, names.aliases_key)
