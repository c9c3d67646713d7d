"""The outbox persister against real Redis and PostgreSQL: idempotent, ordered, reclaiming."""

import asyncio
import datetime as dt
import uuid

import asyncpg
import pytest

from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import MessageRow, Outbox, UsageRow
from services.sessions.persister import Persister
from shared.names import Names
from tests.e2e.tcpproxy import TcpProxy


@pytest.fixture
async def setup(database_url, redis_client, namespace):
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    names = Names(f"{namespace}-persist-{uuid.uuid4().hex[:6]}")
    session = uuid.uuid4()
    await pool.execute("INSERT INTO conversations (id, tenant) VALUES ($1, 't')", session)
    yield pool, names, session
    await redis_client.delete(names.outbox)
    await pool.close()


def _persister(redis_client, pool, names, *, reclaim_after_ms: int = 60_000) -> Persister:
    return Persister(
        client=redis_client,
        db=pool,
        names=names,
        metrics=SessionsMetrics(),
        batch_size=100,
        flush_interval_ms=50,
        reclaim_after_ms=reclaim_after_ms,
    )


def _row(session: uuid.UUID, seq: int, content: str = "hi") -> MessageRow:
    return MessageRow(
        id=str(uuid.uuid4()),
        conversation_id=str(session),
        seq=seq,
        role="user",
        content=content,
        status="complete",
        created_at=dt.datetime.now(dt.UTC),
    )


async def _stop(persister: Persister, task: asyncio.Task) -> None:
    """Stop the persister; it must return promptly (no cancellation needed)."""
    persister.stop()
    await asyncio.wait_for(task, timeout=5)


async def _wait_drained(redis_client, names: Names, timeout_s: float = 5) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await redis_client.xlen(names.outbox) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("outbox not drained")


async def test_duplicates_and_rows_of_deleted_sessions_are_skipped(setup, redis_client) -> None:
    pool, names, session = setup
    outbox = Outbox(redis_client, names)
    tricky = "tab\there, newline\nthere, backslash \\ and unicode é"
    first = _row(session, 1, tricky)
    await outbox.append("message", first)
    await outbox.append("message", first)  # a redelivered entry
    await outbox.append("message", _row(uuid.uuid4(), 1))  # its session is gone
    await outbox.append("message", _row(session, 2))
    persister = _persister(redis_client, pool, names)
    task = asyncio.create_task(persister.run())
    try:
        await _wait_drained(redis_client, names)
    finally:
        await _stop(persister, task)
    rows = await pool.fetch("SELECT seq, content FROM messages WHERE conversation_id = $1 ORDER BY seq", session)
    assert [(r["seq"], r["content"]) for r in rows] == [(1, tricky), (2, "hi")]


async def test_usage_rows_travel_in_the_same_batches_as_messages(setup, redis_client) -> None:
    pool, names, session = setup
    outbox = Outbox(redis_client, names)
    job_id = str(uuid.uuid4())
    await outbox.append("message", _row(session, 1))
    await outbox.append(
        "usage",
        UsageRow(
            job_id=job_id,
            tenant="t",
            key_id=None,
            model="m",
            prompt_tokens=7,
            completion_tokens=9,
            latency_ms=12,
            created_at=dt.datetime.now(dt.UTC),
        ),
    )
    await outbox.append("message", _row(session, 2))
    persister = _persister(redis_client, pool, names)
    task = asyncio.create_task(persister.run())
    try:
        await _wait_drained(redis_client, names)
    finally:
        await _stop(persister, task)
    usage = await pool.fetchrow(
        "SELECT tenant, prompt_tokens, completion_tokens FROM usage WHERE job_id = $1", uuid.UUID(job_id)
    )
    assert dict(usage) == {"tenant": "t", "prompt_tokens": 7, "completion_tokens": 9}
    count = await pool.fetchval("SELECT count(*) FROM messages WHERE conversation_id = $1", session)
    assert count == 2


async def test_entries_left_pending_by_a_dead_persister_are_reclaimed(setup, redis_client) -> None:
    pool, names, session = setup
    outbox = Outbox(redis_client, names)
    dead = _persister(redis_client, pool, names)
    await dead.ensure_group()
    for seq in range(1, 6):
        await outbox.append("message", _row(session, seq))
    # The dead persister read the entries and died before committing them.
    taken = await redis_client.xreadgroup(names.outbox_group, dead.consumer, {names.outbox: ">"}, count=10)
    assert len(taken[0][1]) == 5
    live = _persister(redis_client, pool, names, reclaim_after_ms=200)
    await asyncio.sleep(0.3)
    task = asyncio.create_task(live.run())
    try:
        await _wait_drained(redis_client, names)
    finally:
        await _stop(live, task)
    count = await pool.fetchval("SELECT count(*) FROM messages WHERE conversation_id = $1", session)
    assert count == 5


async def test_everything_is_written_once_postgres_is_reachable_again(setup, redis_client, database_url) -> None:
    """Batches in flight when PostgreSQL goes away stay pending and are reclaimed; nothing lost or
    doubled, with several batches committing at once."""
    _pool, names, session = setup
    proxy = TcpProxy.to(database_url)
    pool = await asyncpg.create_pool(proxy.proxied(database_url), min_size=0, max_size=4, timeout=2)
    outbox = Outbox(redis_client, names)
    persister = Persister(
        client=redis_client,
        db=pool,
        names=names,
        metrics=SessionsMetrics(),
        batch_size=10,
        flush_interval_ms=20,
        reclaim_after_ms=500,
        concurrency=3,
        commit_timeout_s=3,
    )
    task = asyncio.create_task(persister.run())
    try:
        seq = 0
        for phase in ("up", "down", "up"):
            if phase == "down":
                proxy.cut()
            elif seq:
                proxy.restore()
            for _ in range(60):
                seq += 1
                await outbox.append("message", _row(session, seq))
                await asyncio.sleep(0.05)
        await _wait_drained(redis_client, names, timeout_s=15)
    finally:
        await _stop(persister, task)
        await pool.close()
        proxy.close()
    seqs = await _pool.fetch("SELECT seq FROM messages WHERE conversation_id = $1 ORDER BY seq", session)
    assert [r["seq"] for r in seqs] == list(range(1, seq + 1))
