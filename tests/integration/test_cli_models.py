"""`axon models list` against the real Redis: live models with their workers and context, each LoRA
adapter with its base model, and aliases."""

import asyncio
import os
import subprocess
import sys
import uuid

from shared.clients import create_redis
from shared.names import Names
from shared.registry import WorkerRegistry


def test_models_list_names_each_adapters_base_model(service_urls, namespace) -> None:
    names = Names(f"{namespace}-cli-{uuid.uuid4().hex[:6]}")

    async def seed() -> None:
        client = create_redis(service_urls.redis, timeout_s=5)
        try:
            registry = WorkerRegistry(client, names)
            await registry.heartbeat(
                worker_id="w1", model="base", ttl_s=30, max_seqs=4, context_tokens=2048, adapters=["sql"]
            )
            await registry.set_alias("sql-prod", "sql")
        finally:
            await client.aclose()

    async def clean() -> None:
        client = create_redis(service_urls.redis, timeout_s=5)
        try:
            await client.delete(names.workers_key, names.models_key, names.adapters_key, names.aliases_key)
        finally:
            await client.aclose()

    asyncio.run(seed())
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "services.cli.main", "models", "list"],
            env={**os.environ, "AXON_NAMESPACE": names.namespace, "AXON_REDIS_URL": service_urls.redis},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        asyncio.run(clean())
    lines = [" ".join(line.split()) for line in listed.stdout.splitlines()]
    assert lines == [
        "base workers=1 context=2048",
        "sql workers=1 context=2048 adapter of base",
        "sql-prod -> sql",
    ]
