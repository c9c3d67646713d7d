"""The outbox persister against real Redis and PostgreSQL: idempotent, ordered, reclaiming; and the
session store reading only its own deployment's sessions."""

import asyncio
import datetime as dt
import json
import uuid

import asyncpg
import pytest

from services.sessions.history import SessionInfo, SessionStore, StoredMessage
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import MessageRow, Outbox
from services.sessions.persister import Persister
from shared.errors import NotFound
from shared.names import Names
from shared.schemas import FunctionCall, Message, ToolCall
from shared.usage import UsageRow
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


async def _drain(redis_client, pool, names: Names) -> None:
    """Run a persister until the outbox is empty."""
    persister = _persister(redis_client, pool, names)
    task = asyncio.create_task(persister.run())
    try:
        await _wait_drained(redis_client, names)
    finally:
        await _stop(persister, task)


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
    await _drain(redis_client, pool, names)
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
    await _drain(redis_client, pool, names)
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


async def test_tool_calls_are_stored_and_read_back_and_old_entries_still_persist(setup, redis_client) -> None:
    """An answer's tool calls (as jsonb, NUL made storable) and a tool result's call id and name
    reach PostgreSQL and come back from it; an entry in the format written before messages had
    tool calls (no `format` field, 8 columns) shares the batch and gets NULLs."""
    pool, names, session = setup
    outbox = Outbox(redis_client, names)
    arguments = '{"city": "Paris\\tFrance", "q": "a\\\\b \\"quoted\\" \x00 é"}'
    calls = [ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments=arguments))]
    now = dt.datetime.now(dt.UTC)
    answer = StoredMessage(id=str(uuid.uuid4()), seq=2, role="assistant", content="", created_at=now, tool_calls=calls)
    result = StoredMessage(
        id=str(uuid.uuid4()), seq=3, role="tool", content="22 C", created_at=now, tool_call_id="call_1", name="w"
    )
    old = _row(session, 1, "from before")
    old_line = b"\t".join(old.copy_line().split(b"\t")[:8]) + b"\n"
    await redis_client.xadd(names.outbox, {"kind": "message", "copy": old_line})
    for message in (answer, result):
        await outbox.append("message", MessageRow.of(message, conversation_id=str(session)))
    await _drain(redis_client, pool, names)
    rows = await pool.fetch(
        "SELECT seq, content, tool_calls, tool_call_id, name FROM messages WHERE conversation_id = $1 ORDER BY seq",
        session,
    )
    assert [(r["seq"], r["content"], r["tool_call_id"], r["name"]) for r in rows] == [
        (1, "from before", None, None),
        (2, "", None, None),
        (3, "22 C", "call_1", "w"),
    ]
    assert rows[0]["tool_calls"] is None and rows[2]["tool_calls"] is None
    stored = json.loads(rows[1]["tool_calls"])
    assert stored == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments.replace("\x00", "\ufffd")},
        }
    ]

    # Read back by the store (PostgreSQL first; the Redis history of this session is empty).
    metrics, history = SessionsMetrics(), {"history_max_messages": 10, "cache_ttl_s": 60}
    store = SessionStore(client=redis_client, db=pool, names=names, outbox=outbox, metrics=metrics, **history)
    info = SessionInfo(id=str(session), tenant="t", created_at=now, updated_at=now)
    page, _ = await store.page(info, after_seq=0, limit=10)
    assert [m.public().get("tool_calls") for m in page] == [None, stored, None]
    assert page[1].public()["content"] is None  # an answer that is only tool calls
    assert (page[2].public()["tool_call_id"], page[2].public()["name"]) == ("call_1", "w")
    history = await store.history(info)  # re-cached in Redis, and read from there next time
    assert history == await store.history(info)
    assert history[1].tool_calls is not None and history[1].tool_calls[0].function.name == "get_weather"
    await redis_client.delete(names.history(str(session)))


async def test_a_session_counter_expires_with_its_history_and_continues_after_the_last_message(
    setup, redis_client
) -> None:
    """The seq counter expires as the history does; once gone, it continues after the newest
    message, whether that is only in the Redis history (still in the outbox) or in PostgreSQL."""
    pool, names, _ = setup
    outbox = Outbox(redis_client, names)
    store = SessionStore(
        client=redis_client,
        db=pool,
        names=names,
        outbox=outbox,
        metrics=SessionsMetrics(),
        history_max_messages=10,
        cache_ttl_s=60,
    )
    info = await store.create("t", title=None, system_prompt=None, model=None)
    counter = names.session_seq(info.id)
    assert 0 < await redis_client.ttl(counter) <= 60
    said = Message(role="user", content="hi")
    assert [(await store.append(info, said, status="complete", job_id=None)).seq for _ in range(2)] == [1, 2]
    assert 0 < await redis_client.ttl(counter) <= 60
    await redis_client.delete(counter)  # expired: both messages are still only in Redis
    assert (await store.append(info, said, status="complete", job_id=None)).seq == 3
    await _drain(redis_client, pool, names)
    await redis_client.delete(counter, names.history(info.id))  # both expired: PostgreSQL has the messages
    assert (await store.append(info, said, status="complete", job_id=None)).seq == 4
    await redis_client.delete(counter, names.history(info.id), names.session(info.id))


async def test_a_deployment_reads_and_lists_only_its_own_sessions(setup, redis_client) -> None:
    """Two deployments (namespaces) on one database: a session of one, its Redis copy gone, is
    neither read nor listed by the other."""
    pool, names, _ = setup
    theirs = Names(f"{names.namespace}-theirs")

    def store(of: Names) -> SessionStore:
        return SessionStore(
            client=redis_client,
            db=pool,
            names=of,
            outbox=Outbox(redis_client, of),
            metrics=SessionsMetrics(),
            history_max_messages=10,
            cache_ttl_s=60,
        )

    tenant = f"t-{uuid.uuid4().hex[:8]}"
    info = await store(theirs).create(tenant, title=None, system_prompt=None, model=None)
    await redis_client.delete(theirs.session(info.id))
    assert await store(names).list_sessions(tenant, limit=10, after=None) == ([], False)
    with pytest.raises(NotFound):
        await store(names).get(tenant, info.id)
    assert (await store(theirs).get(tenant, info.id)).id == info.id
    assert [s.id for s in (await store(theirs).list_sessions(tenant, limit=10, after=None))[0]] == [info.id]
