"""The write-behind persister against raw asyncpg COPY into the same table, and the
write-behind lag (stored in Redis -> committed in PostgreSQL) at a steady message rate.

    .venv/bin/python benchmarks/persister_vs_copy.py --rows 20000 --rate 500 --seconds 10

Uses its own database (axon_bench_*) and Redis namespace, dropped at the end.
"""

import argparse
import asyncio
import datetime as dt
import statistics
import time
import uuid

import asyncpg

from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import MessageRow, Outbox
from services.sessions.persister import Batch, Persister
from shared.clients import create_redis
from shared.migrations import drop_database, migrate, split_database_url
from shared.names import Names

SESSIONS = 200


def make_rows(conversations: list[uuid.UUID], count: int, *, start_seq: int) -> list[MessageRow]:
    now = dt.datetime.now(dt.UTC)
    return [
        MessageRow(
            id=str(uuid.uuid4()),
            conversation_id=str(conversations[i % len(conversations)]),
            seq=start_seq + i // len(conversations),
            role="user" if i % 2 else "assistant",
            content=f"message {i} " + "lorem ipsum " * 8,
            status="complete",
            created_at=now,
        )
        for i in range(count)
    ]


class TimedPersister(Persister):
    """Records, for every row it commits, how long after Redis stored it (the time in its
    stream entry's id) the commit happened."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lags_s: list[float] = []

    async def _commit(self, batch: Batch) -> None:
        await super()._commit(batch)
        now_ms = time.time() * 1000
        self.lags_s.extend((now_ms - int(entry_id.split(b"-")[0])) / 1000 for entry_id in batch.ids.split())


async def stop(persister: Persister, task: asyncio.Task) -> None:
    persister.stop()
    await asyncio.wait_for(task, timeout=30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rate", type=int, default=500, help="messages per second for the lag run")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=5, help="throughput runs of each side")
    parser.add_argument("--batch-size", type=int, default=2000, help="as AXON_PERSIST_BATCH_SIZE")
    parser.add_argument("--concurrency", type=int, default=2, help="as AXON_PERSIST_CONCURRENCY")
    parser.add_argument("--flush-interval-ms", type=int, default=100)
    args = parser.parse_args()

    run = uuid.uuid4().hex[:8]
    admin_url, _ = split_database_url(args.postgres)
    url = admin_url.rsplit("/", 1)[0] + f"/axon_bench_{run}"
    await migrate(url)
    pool = await asyncpg.create_pool(url, min_size=2, max_size=4)
    client = create_redis(args.redis, timeout_s=10)
    names = Names(f"axon_bench_{run}")
    try:
        conversations = [uuid.uuid4() for _ in range(SESSIONS)]
        await pool.executemany(
            "INSERT INTO conversations (id, tenant) VALUES ($1, 'bench')", [(c,) for c in conversations]
        )
        outbox = Outbox(client, names)

        def new_persister() -> TimedPersister:
            return TimedPersister(
                client=client,
                db=pool,
                names=names,
                metrics=SessionsMetrics(),
                batch_size=args.batch_size,
                flush_interval_ms=args.flush_interval_ms,
                reclaim_after_ms=60_000,
                concurrency=args.concurrency,
            )

        await new_persister().ensure_group()

        # 1. Throughput: a full outbox drained by the persister, vs COPY of as many rows; the two
        # alternate `--repeat` times and the medians are compared (the machine's noise hits both).
        persister_runs, copy_runs = [], []
        for attempt in range(args.repeat):
            rows = make_rows(conversations, args.rows, start_seq=1 + 2 * attempt * args.rows)
            for i in range(0, len(rows), 1000):
                async with client.pipeline(transaction=False) as pipe:
                    for row in rows[i : i + 1000]:
                        await outbox.append("message", row, pipe=pipe)
                    await pipe.execute()
            persister = new_persister()
            task = asyncio.create_task(persister.run())
            started = time.perf_counter()
            while await client.xlen(names.outbox) > 0:
                await asyncio.sleep(0.01)
            persister_runs.append(time.perf_counter() - started)
            await stop(persister, task)
            copy_rows = make_rows(conversations, args.rows, start_seq=1 + (2 * attempt + 1) * args.rows)
            records = [
                (uuid.UUID(r.id), uuid.UUID(r.conversation_id), r.seq, r.role, r.content, r.status, None, r.created_at)
                for r in copy_rows
            ]
            started = time.perf_counter()
            async with pool.acquire() as conn:
                await conn.copy_records_to_table(
                    "messages",
                    records=records,
                    columns=["id", "conversation_id", "seq", "role", "content", "status", "job_id", "created_at"],
                )
            copy_runs.append(time.perf_counter() - started)
        count = await pool.fetchval("SELECT count(*) FROM messages")
        assert count == 2 * args.rows * args.repeat, count
        persister_s, copy_s = statistics.median(persister_runs), statistics.median(copy_runs)

        # 2. Lag at a steady rate.
        persister = new_persister()
        task = asyncio.create_task(persister.run())
        lag_rows = make_rows(conversations, int(args.rate * args.seconds), start_seq=20_000_000)
        interval = 1 / args.rate
        started = time.perf_counter()
        for i, row in enumerate(lag_rows):
            due = started + i * interval
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await outbox.append("message", row)
        while len(persister.lags_s) < len(lag_rows):
            await asyncio.sleep(0.05)
        await stop(persister, task)
        lags = sorted(persister.lags_s)
        p50, p99 = lags[len(lags) // 2], lags[int(len(lags) * 0.99)]

        print(f"batch size {args.batch_size}, medians of {args.repeat} alternating runs")
        print(f"persister: {args.rows} rows in {persister_s:.2f} s = {args.rows / persister_s:,.0f} rows/s")
        print(f"COPY:      {args.rows} rows in {copy_s:.2f} s = {args.rows / copy_s:,.0f} rows/s")
        print(f"ratio persister/COPY = {copy_s / persister_s:.2f} (target >= 0.8)")
        print(
            f"lag at {args.rate} msg/s for {args.seconds:.0f} s: p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
            f"max {lags[-1] * 1000:.0f} ms, mean {statistics.mean(lags) * 1000:.0f} ms (target p99 <= 1000 ms)"
        )
    finally:
        await client.delete(names.outbox)
        await client.aclose()
        await pool.close()
        await drop_database(url)


if __name__ == "__main__":
    asyncio.run(main())
