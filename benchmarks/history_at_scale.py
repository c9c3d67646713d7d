"""The session manager's PostgreSQL reads at a million messages: listing a tenant's sessions
(newest first, paged), reading a session's messages (oldest first, paged), reloading a session's
recent history on a cache miss, finding the next sequence number, deleting a session. Each runs
through the real `SessionStore` with the Redis cache emptied first, so every call reaches
PostgreSQL; the script prints each query's latency and the plan PostgreSQL chose for it.

    .venv/bin/python benchmarks/history_at_scale.py --messages 1000000

Uses its own database (axon_bench_*) and Redis namespace, dropped at the end.
"""

import argparse
import asyncio
import datetime as dt
import random
import statistics
import time
import uuid

import asyncpg

from services.sessions.history import SessionStore
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox
from shared.clients import create_redis
from shared.migrations import drop_database, migrate, split_database_url
from shared.names import Names

TENANTS = 50


class RecordingPool:
    """Passes queries to the pool and keeps them, so their plans can be shown."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self.queries: list[tuple[str, tuple]] = []

    async def fetch(self, query: str, *args):
        self.queries.append((query, args))
        return await self._pool.fetch(query, *args)

    async def fetchrow(self, query: str, *args):
        self.queries.append((query, args))
        return await self._pool.fetchrow(query, *args)

    async def fetchval(self, query: str, *args):
        self.queries.append((query, args))
        return await self._pool.fetchval(query, *args)

    async def execute(self, query: str, *args):
        self.queries.append((query, args))
        return await self._pool.execute(query, *args)


async def load(pool: asyncpg.Pool, messages: int, sessions: int) -> list[tuple[str, uuid.UUID, int]]:
    """`sessions` sessions over TENANTS tenants (tenant 0 holds a tenth of them), `messages`
    messages over the sessions (session 0 of each tenant holds 1%). Returns (tenant, id, count)."""
    started = time.perf_counter()
    base = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    conversations = []
    for i in range(sessions):
        tenant = "tenant-0" if i % 10 == 0 else f"tenant-{i % TENANTS}"
        conversations.append((uuid.uuid4(), tenant, f"session {i}", base + dt.timedelta(seconds=i)))
    await pool.copy_records_to_table(
        "conversations", records=conversations, columns=["id", "tenant", "title", "created_at"]
    )
    heavy = {c[0] for c in conversations[:TENANTS]}
    weights = [messages // 100 if c[0] in heavy else 1 for c in conversations]
    counts: dict[uuid.UUID, int] = {c[0]: 0 for c in conversations}
    picks = random.choices([c[0] for c in conversations], weights=weights, k=messages)
    chunk = 100_000
    for start in range(0, messages, chunk):
        records = []
        for conversation in picks[start : start + chunk]:
            counts[conversation] += 1
            seq = counts[conversation]
            records.append(
                (
                    uuid.uuid4(),
                    conversation,
                    seq,
                    "user" if seq % 2 else "assistant",
                    f"message {seq} " + "lorem ipsum " * 10,
                    "complete",
                    base + dt.timedelta(seconds=seq),
                )
            )
        await pool.copy_records_to_table(
            "messages",
            records=records,
            columns=["id", "conversation_id", "seq", "role", "content", "status", "created_at"],
        )
        print(f"  loaded {min(start + chunk, messages):,} / {messages:,} messages", flush=True)
    await pool.execute("ANALYZE")
    print(f"loaded {sessions:,} sessions and {messages:,} messages in {time.perf_counter() - started:.0f} s")
    return [(tenant, cid, counts[cid]) for cid, tenant, _title, _at in conversations]


async def measure(name: str, runs: int, call, pool: asyncpg.Pool, recorder: RecordingPool, prepare=None) -> None:
    """Time `call` (not `prepare`, which readies each call) and show the plans of its queries."""
    times = []
    for _ in range(runs):
        arg = await prepare() if prepare else None
        recorder.queries = []
        started = time.perf_counter()
        await call(arg)
        times.append((time.perf_counter() - started) * 1000)
    scans = []
    for query, args in recorder.queries:
        plan = await pool.fetch(f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) {query}", *args)
        scans += [node for r in plan if "Scan" in (node := r[0].strip().lstrip("-> "))]
    times.sort()
    print(
        f"{name:<28} p50 {statistics.median(times):6.2f} ms  p99 {times[int(len(times) * 0.99)]:6.2f} ms  "
        f"plan: {'; '.join(scans)}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=200, help="calls per query")
    args = parser.parse_args()

    run = uuid.uuid4().hex[:8]
    admin_url, _ = split_database_url(args.postgres)
    url = admin_url.rsplit("/", 1)[0] + f"/axon_bench_{run}"
    await migrate(url)
    pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
    client = create_redis(args.redis, timeout_s=10)
    names = Names(f"axon_bench_{run}")
    recorder = RecordingPool(pool)
    store = SessionStore(
        client=client,
        db=recorder,
        names=names,
        outbox=Outbox(client, names),
        metrics=SessionsMetrics(),
        history_max_messages=200,
        cache_ttl_s=3600,
    )
    try:
        sessions = await load(pool, args.messages, args.sessions)
        by_tenant: dict[str, list[tuple[uuid.UUID, int]]] = {}
        for tenant, cid, count in sessions:
            by_tenant.setdefault(tenant, []).append((cid, count))
        heavy_tenant = by_tenant["tenant-0"]
        biggest = max(sessions, key=lambda s: s[2])
        print(f"tenant-0 has {len(heavy_tenant):,} sessions; the largest session has {biggest[2]:,} messages\n")

        async def forget(*ids: uuid.UUID) -> None:
            """Empty the Redis cache of these sessions, so the next call reads PostgreSQL."""
            for cid in ids:
                await client.delete(names.session(str(cid)), names.history(str(cid)), names.session_seq(str(cid)))

        async def session_info(tenant: str, cid: uuid.UUID):
            await forget(cid)
            info = await store.get(tenant, str(cid))
            await forget(cid)
            return info

        async def first_page(_arg) -> None:
            await store.list_sessions("tenant-0", limit=20, after=None)

        async def deep_cursor() -> uuid.UUID:
            cid, _count = random.choice(heavy_tenant)
            await forget(cid)
            return cid

        async def deep_page(cid: uuid.UUID) -> None:
            await store.list_sessions("tenant-0", limit=20, after=str(cid))

        async def messages_page(info) -> None:
            await store.page(info, after_seq=random.randrange(max(1, biggest[2] - 100)), limit=100)

        async def random_session():
            tenant, cid, _count = random.choice(sessions)
            return await session_info(tenant, cid)

        async def biggest_session():
            return await session_info(biggest[0], biggest[1])

        async def history_reload(info) -> None:
            await store.history(info)

        async def next_seq(info) -> None:
            await store._next_seq(info.id)

        victims = iter(random.sample(sessions, args.runs))

        async def victim():
            tenant, cid, _count = next(victims)
            await forget(cid)
            return tenant, cid

        async def delete(victim: tuple[str, uuid.UUID]) -> None:
            await store.delete(victim[0], str(victim[1]))

        await measure("list sessions, first page", args.runs, first_page, pool, recorder)
        await measure("list sessions, deep page", args.runs, deep_page, pool, recorder, deep_cursor)
        await measure("messages page (largest)", args.runs, messages_page, pool, recorder, biggest_session)
        await measure("history reload (random)", args.runs, history_reload, pool, recorder, random_session)
        await measure("history reload (largest)", args.runs, history_reload, pool, recorder, biggest_session)
        await measure("next seq (largest)", args.runs, next_seq, pool, recorder, biggest_session)
        await measure("delete session (cascade)", args.runs, delete, pool, recorder, victim)
    finally:
        await client.aclose()
        await pool.close()
        await drop_database(url)


if __name__ == "__main__":
    asyncio.run(main())
