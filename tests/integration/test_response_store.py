"""Stored responses against real Redis and PostgreSQL: written behind through the outbox, read
back when Redis misses, a deletion that outruns the outbox stays deleted, expired rows go."""

import asyncio
import time
import uuid

import asyncpg
import pytest

from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox
from services.sessions.persister import Persister
from services.sessions.responses.store import ResponseStore, StoredResponse
from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import Message


@pytest.fixture
async def setup(database_url, redis_client, namespace, service_urls):
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    names = Names(f"{namespace}-responses-{uuid.uuid4().hex[:6]}")
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    store = ResponseStore(
        redis_client, pool, Outbox(redis_client, names), namespace=names.namespace, ttl_s=3600, pipe=pipe
    )
    yield pool, names, store
    await redis_client.delete(names.outbox)
    await pool.close()
    await pipe.aclose()


async def _drain(redis_client, pool, names: Names) -> None:
    persister = Persister(
        client=redis_client,
        db=pool,
        names=names,
        metrics=SessionsMetrics(),
        batch_size=100,
        flush_interval_ms=20,
        reclaim_after_ms=60_000,
    )
    task = asyncio.create_task(persister.run())
    try:
        for _ in range(100):
            if await redis_client.xlen(names.outbox) == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("outbox not drained")
    finally:
        persister.stop()
        await asyncio.wait_for(task, timeout=5)


def _stored(tenant: str = "t", text: str = "hello") -> StoredResponse:
    return StoredResponse(
        tenant=tenant,
        response={"id": "x", "object": "response", "output": [{"text": text}]},
        input_items=[{"id": "msg_1", "type": "message"}],
        context=[Message(role="user", content=text)],
    )


async def _save(store: ResponseStore, response_id: str, stored: StoredResponse) -> None:
    """Store `stored` as a response is: unfinished, then finished (written behind)."""
    await store.open(response_id, stored, owner="test", lease_expiry_ms=int(time.time() * 1000) + 60_000)
    assert await store.finish(response_id, stored)


def _id() -> str:
    return "resp_" + uuid.uuid4().hex


async def test_a_response_is_written_behind_and_read_back_after_redis_loses_it(setup, redis_client) -> None:
    pool, names, store = setup
    response_id = _id()
    await _save(store, response_id, _stored(text="nul \x00 kept apart"))
    await _drain(redis_client, pool, names)
    await redis_client.delete(store.key(response_id))
    again = await store.get("t", response_id)
    assert again is not None and again.context[0].content == "nul \ufffd kept apart"
    assert await store.get("other", response_id) is None
    assert await pool.fetchval("SELECT tenant FROM responses WHERE id = $1", response_id) == "t"


async def test_a_deletion_before_the_outbox_commit_stays_deleted(setup, redis_client) -> None:
    pool, names, store = setup
    response_id = _id()
    await _save(store, response_id, _stored())
    assert not await store.delete("other", response_id)  # another tenant's: untouched
    assert await store.delete("t", response_id)
    await _drain(redis_client, pool, names)  # the entry commits after the deletion
    assert await store.get("t", response_id) is None
    assert await pool.fetchval("SELECT body FROM responses WHERE id = $1", response_id) is None
    assert not await store.delete("t", response_id)


async def test_expired_rows_are_neither_read_nor_kept(setup, redis_client) -> None:
    pool, names, store = setup
    old = _id()
    await pool.execute(
        "INSERT INTO responses (id, tenant, body, created_at, expires_at) "
        "VALUES ($1, 't', $2::jsonb, now() - interval '2 days', now() - interval '1 day')",
        old,
        _stored().model_dump_json(),
    )
    assert await store.get("t", old) is None
    await _save(store, _id(), _stored())
    await _drain(redis_client, pool, names)  # a batch with a response deletes expired rows
    assert await pool.fetchval("SELECT count(*) FROM responses WHERE id = $1", old) == 0
