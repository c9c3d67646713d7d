"""Fixtures every test layer shares: a namespace and a database of the run's own.

Tests talk to the real Redis, RabbitMQ and PostgreSQL at their default local addresses
(override with AXON_TEST_REDIS_URL, AXON_TEST_AMQP_URL, AXON_TEST_POSTGRES_URL). Each run
uses its own `axon_test_*` namespace and database, so it never touches a running stack.
"""

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from shared.keys import KeyLimits, KeyRepository
from shared.migrations import drop_database, migrate, split_database_url

REDIS_URL = os.environ.get("AXON_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("AXON_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
POSTGRES_URL = os.environ.get("AXON_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(scope="session")
def run_id() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def namespace(run_id: str) -> str:
    return f"axon_test_{run_id}"


@pytest.fixture(scope="session")
def database_url(run_id: str) -> Iterator[str]:
    """A migrated database of this run's own, dropped at the end."""
    admin_url, _ = split_database_url(POSTGRES_URL)
    url = admin_url.rsplit("/", 1)[0] + f"/axon_test_{run_id}"
    asyncio.run(migrate(url))
    yield url
    asyncio.run(drop_database(url))


@pytest.fixture
async def redis_client() -> AsyncIterator:
    from shared.clients import create_redis

    client = create_redis(REDIS_URL, timeout_s=5)
    yield client
    await client.aclose()


async def create_key(database_url: str, *, name: str, limits: KeyLimits, tenant: str | None = None) -> str:
    """Create an API key in the test database; returns the key."""
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    try:
        key, _record = await KeyRepository(pool).create(name=name, limits=limits, tenant=tenant)
        return key
    finally:
        await pool.close()


@pytest.fixture(scope="session")
def api_key(database_url: str) -> str:
    """A key with limits far above anything the tests send."""
    limits = KeyLimits(rpm=1_000_000, tpm=100_000_000, max_concurrent=10_000)
    return asyncio.run(create_key(database_url, name="tests", limits=limits, tenant="tests"))
