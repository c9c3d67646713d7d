"""What the usage table's partitions, rollups and retention cost (shared/migrations/sql/
0008_usage_partitions.sql, services/sessions/usage_retention.py):

1. The persister's usage INSERT into the table as it was before (migrations up to 0007), into the
   partitioned table without the rollup trigger, and into the table as it is, alternating
   `--repeat` times, as rows per CPU second of the PostgreSQL backend doing it (its CPU time is
   read from /proc, so the load of a shared machine moves it far less than wall time).
2. The migration of a table of `--rows` rows spread over a year (20 keys of 5 tenants, 3 models),
   then the first retention run (90 days) over it and the next; and `/admin/usage`'s query for the
   last 30 days as it was (over the raw rows, before the migration) and as it is (over the rollups).

    .venv/bin/python benchmarks/usage_retention.py --rows 1000000

Uses its own databases (axon_bench_*), dropped at the end; PostgreSQL must run on this machine.
"""

import argparse
import asyncio
import datetime as dt
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from services.sessions.persister import _INSERT_USAGE
from services.sessions.usage_retention import UsageRetention
from shared.migrations import drop_database, migrate, pending_files


def _url(base: str) -> str:
    return base.rsplit("/", 1)[0] + f"/axon_bench_usage_{uuid.uuid4().hex[:8]}"


async def _database(base: str, migrations: Path | None, *, trigger: bool = True) -> str:
    url = _url(base)
    await (migrate(url, migrations_dir=migrations) if migrations else migrate(url))
    if not trigger:
        conn = await asyncpg.connect(url)
        await conn.execute("DROP TRIGGER usage_roll_up ON usage")
        await conn.close()
    return url


async def _rows_per_cpu_second(url: str, rows: int, batch: int) -> float:
    conn = await asyncpg.connect(url)
    try:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        now = dt.datetime.now(dt.UTC)
        batches = [
            [
                [uuid.uuid4() for _ in range(batch)],
                ["tenant"] * batch,
                [f"key_{i % 50}" for i in range(batch)],
                [f"model_{i % 2}" for i in range(batch)],
                [100] * batch,
                [200] * batch,
                [300] * batch,
                [now] * batch,
            ]
            for _ in range(rows // batch)
        ]

        def cpu_s() -> float:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        started = cpu_s()
        for columns in batches:
            async with conn.transaction():
                await conn.execute(_INSERT_USAGE, *columns)
        return rows / (cpu_s() - started)
    finally:
        await conn.close()


async def inserts(base: str, before: Path, *, rows: int, batch: int, repeat: int) -> None:
    kinds = {
        "before (one table)": await _database(base, before),
        "partitioned, no rollup trigger": await _database(base, None, trigger=False),
        "partitioned with rollups (now)": await _database(base, None),
    }
    measured: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        for round_ in range(repeat):
            order = list(kinds.items())
            for kind, url in order[round_ % 3 :] + order[: round_ % 3]:
                measured[kind].append(await _rows_per_cpu_second(url, rows, batch))
    finally:
        for url in kinds.values():
            await drop_database(url)
    print(f"usage INSERT, {repeat} runs of {rows:,} rows in batches of {batch:,} (rows per CPU second of the backend):")
    for kind, values in measured.items():
        spread = f"min {min(values):,.0f}, max {max(values):,.0f}"
        print(f"  {kind:32} median {statistics.median(values):>9,.0f}  ({spread})")


# /admin/usage's query before 0008 (services/gateway/api/admin.py), and now.
_ADMIN_USAGE_BEFORE = (
    "SELECT key_id, (created_at AT TIME ZONE 'UTC')::date AS day, count(*) AS requests,"
    " sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens"
    " FROM usage WHERE created_at >= now() - interval '30 days' GROUP BY key_id, day ORDER BY day, key_id"
)
_ADMIN_USAGE_NOW = (
    "SELECT key_id, day, sum(requests)::bigint AS requests, sum(prompt_tokens)::bigint AS prompt_tokens,"
    " sum(completion_tokens)::bigint AS completion_tokens FROM usage_daily"
    " WHERE day >= (now() - interval '30 days')::date GROUP BY key_id, day ORDER BY day, key_id"
)


async def _timed(conn: asyncpg.Connection | PoolConnectionProxy, query: str) -> float:
    """The median wall time of `query`, over 5 runs after one to warm the cache."""
    times = []
    for _ in range(6):
        started = time.perf_counter()
        await conn.fetch(query)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


async def migration_and_retention(base: str, before: Path, *, rows: int) -> None:
    url = await _database(base, before)
    try:
        conn = await asyncpg.connect(url)
        await conn.execute(
            "INSERT INTO usage (job_id, tenant, key_id, model, prompt_tokens, completion_tokens, latency_ms,"
            " created_at) SELECT gen_random_uuid(), 'tenant_' || (i % 20 % 5), 'key_' || (i % 20), 'model_' || (i % 3),"
            " 100, 200, 300,"
            " now() - (i::float / $1) * interval '365 days' FROM generate_series(1, $1) i",
            rows,
        )
        raw_query_s = await _timed(conn, _ADMIN_USAGE_BEFORE)
        await conn.close()
        started = time.perf_counter()
        await migrate(url)
        took = time.perf_counter() - started
        print(f"migration 0008 of {rows:,} rows over 365 days: {took:.1f} s ({rows / took:,.0f} rows/s)")
        pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
        try:
            for which in ("first", "next"):
                started = time.perf_counter()
                run = await UsageRetention(pool, retention_days=90).run_once()
                assert run is not None
                print(
                    f"retention of 90 days, {which} run: {time.perf_counter() - started:.2f} s,"
                    f" {len(run.dropped)} partitions dropped, {run.deleted_rows:,} rows deleted"
                )
            async with pool.acquire() as conn:
                rollup_query_s = await _timed(conn, _ADMIN_USAGE_NOW)
            print(
                f"/admin/usage, last 30 days, every key (median of 5): over the raw rows {raw_query_s * 1000:.1f} ms,"
                f" over the rollups {rollup_query_s * 1000:.1f} ms"
            )
            left = await pool.fetchval("SELECT count(*) FROM usage")
            rollups = await pool.fetchval("SELECT count(*) FROM usage_daily")
            print(f"left: {left:,} raw rows, {rollups:,} rollup rows (a day, tenant, key and model each)")
        finally:
            await pool.close()
    finally:
        await drop_database(url)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the migrated table")
    parser.add_argument("--insert-rows", type=int, default=200_000, help="rows of each INSERT run")
    parser.add_argument("--batch", type=int, default=2000, help="rows per INSERT (AXON_PERSIST_BATCH_SIZE)")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp)
        for version, path in pending_files():
            if version < "0008":
                shutil.copyfile(str(path), before / path.name)
        await inserts(args.database_url, before, rows=args.insert_rows, batch=args.batch, repeat=args.repeat)
        await migration_and_retention(args.database_url, before, rows=args.rows)


if __name__ == "__main__":
    asyncio.run(main())
