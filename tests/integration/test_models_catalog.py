"""services.sessions.catalog against the real Redis: `/v1/models` entries and `/v1/models/{id}`
from worker heartbeats (context length, what every live worker supports) and aliases."""

import uuid

import pytest

from services.sessions.catalog import ModelCatalog
from shared.errors import ModelNotFound
from shared.names import Names
from shared.registry import WorkerRegistry


async def test_entries_carry_context_length_and_the_capabilities_all_workers_share(redis_client, namespace) -> None:
    names = Names(f"{namespace}-cat-{uuid.uuid4().hex[:6]}")
    registry = WorkerRegistry(redis_client, names)
    catalog = ModelCatalog(registry, cache_ttl_s=0)
    try:
        await registry.heartbeat(
            worker_id="w1", model="m", ttl_s=30, max_seqs=4, context_tokens=8192, supports={"tools", "seed", "stop"}
        )
        await registry.heartbeat(
            worker_id="w2", model="m", ttl_s=30, max_seqs=4, context_tokens=4096, supports={"seed", "stop", "echo"}
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
            "context_length": 4096,
            "capabilities": ["seed", "stop"],
        }
        assert await catalog.entry("m") == entry
        assert await catalog.entry("prod") == {**entry, "id": "prod"}
        assert await catalog.listing() == [
            entry,
            {**entry, "id": "other", "root": "other", "context_length": 2048, "capabilities": []},
            {**entry, "id": "prod"},
        ]
        for unknown in ("nope", "dangling"):
            with pytest.raises(ModelNotFound) as info:
                await catalog.entry(unknown)
            assert info.value.status_code == 404 and info.value.code == "model_not_found"
    finally:
        await redis_client.delete(names.workers_key, names.models_key, names.aliases_key)
