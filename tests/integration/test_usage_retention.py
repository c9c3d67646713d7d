"""The usage table's retention against the real PostgreSQL and Redis: monthly partitions, per-day
rollups counted once whatever the persisters redeliver, raw rows dropped after the retention while
the rollups and `/admin/usage` keep them, and the migration of a table written before."""

import asyncio
import datetime as dt
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from services.gateway.api import admin
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox
from services.sessions.persister import Persister
from services.sessions.usage_retention import UsageRetention, month_start, next_month, partition_name
from shared.migrations import DEFAULT_MIGRATIONS_DIR, drop_database, migrate, pending_files
from shared.names import Names
from shared.usage import UsageRow

ADMIN_TOKEN = "retention-admin-token-0123456789"
NOW = dt.datetime.now(dt.UTC)


@pytest.fixture
async def db(run_id: str, service_urls) -> AsyncIterator[asyncpg.Pool]:
    """A migrated database of the test's own: retention drops partitions of the whole table."""
    url = service_urls.postgres.rsplit("/", 1)[0] + f"/axon_test_{run_id}_usage_{uuid.uuid4().hex[:6]}"
    await migrate(url)
    pool = await asyncpg.create_pool(url, min_size=1, max_size=6)
    yield pool
    await pool.close()
    await drop_database(url)


def _row(*, key: str | None, model: str, age: dt.timedelta, prompt: int = 3, completion: int = 5) -> UsageRow:
    return UsageRow(
        job_id=str(uuid.uuid4()),
        tenant="acme",
        key_id=key,
        model=model,
        prompt_tokens=prompt,
        completion_tokens=completion,
        latency_ms=7,
        created_at=NOW - age,
    )


async def _insert(pool: asyncpg.Pool, rows: list[UsageRow]) -> None:
    await pool.executemany(
        "INSERT INTO usage (job_id, tenant, key_id, model, prompt_tokens, completion_tokens, latency_ms, created_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        [
            (uuid.UUID(r.job_id), r.tenant, r.key_id, r.model, r.prompt_tokens, r.completion_tokens, 7, r.created_at)
            for r in rows
        ],
    )


async def _rollups(pool: asyncpg.Pool) -> dict[tuple, tuple[int, int, int]]:
    rows = await pool.fetch("SELECT * FROM usage_daily")
    return {
        (r["day"], r["tenant"], r["key_id"], r["model"]): (r["requests"], r["prompt_tokens"], r["completion_tokens"])
        for r in rows
    }


def _expected(rows: list[UsageRow]) -> dict[tuple, tuple[int, int, int]]:
    sums: dict[tuple, tuple[int, int, int]] = {}
    for r in rows:
        group = (r.created_at.date(), r.tenant, r.key_id, r.model)
        requests, prompt, completion = sums.get(group, (0, 0, 0))
        sums[group] = (requests + 1, prompt + r.prompt_tokens, completion + r.completion_tokens)
    return sums


async def _partitions(pool: asyncpg.Pool) -> set[str]:
    rows = await pool.fetch(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'usage'::regclass"
    )
    return {r["relname"] for r in rows}


async def test_redelivered_entries_and_concurrent_persisters_are_rolled_up_once(db, redis_client, namespace) -> None:
    names = Names(f"{namespace}-usage-{uuid.uuid4().hex[:6]}")
    outbox = Outbox(redis_client, names)
    rows = [
        _row(key=key, model=model, age=dt.timedelta(days=days), prompt=i, completion=2 * i)
        for i in range(1, 41)
        for key, model, days in ((f"key_{i % 2}", "m1", 0), (None, "m2", 1), ("key_0", "m1", 40))
    ]
    for row in rows:
        await outbox.append("usage", row)
    for row in rows[::3]:
        await outbox.append("usage", row)  # a redelivered entry: the same row again
    persisters = [
        Persister(
            client=redis_client,
            db=db,
            names=names,
            metrics=SessionsMetrics(),
            batch_size=7,
            flush_interval_ms=10,
            reclaim_after_ms=60_000,
            concurrency=2,
        )
        for _ in range(2)
    ]
    tasks = [asyncio.create_task(p.run()) for p in persisters]
    try:
        for _ in range(200):
            if await redis_client.xlen(names.outbox) == 0:
                break
            await asyncio.sleep(0.05)
        assert await redis_client.xlen(names.outbox) == 0, "outbox not drained"
    finally:
        for persister in persisters:
            persister.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        await redis_client.delete(names.outbox)
    assert await db.fetchval("SELECT count(*) FROM usage") == len(rows)
    assert await _rollups(db) == _expected(rows)


async def test_retention_drops_old_raw_rows_and_keeps_rollups_for_admin_usage(db) -> None:
    ages = [dt.timedelta(days=d, hours=1) for d in (200, 130, 95, 89, 31, 1, 0)]
    rows = [_row(key="key_a", model="m", age=age, prompt=i + 1) for i, age in enumerate(ages)]
    rows.append(_row(key=None, model="m", age=ages[0]))
    await _insert(db, rows)
    assert await _rollups(db) == _expected(rows)

    # Kept a year: partitions come for the months whose rows no partition covered, the rows move in.
    run = await UsageRetention(db, retention_days=365, clock=lambda: NOW).run_once()
    assert run is not None and run.dropped == [] and run.deleted_rows == 0
    months = {month_start(r.created_at) for r in rows} | {month_start(NOW), next_month(month_start(NOW))}
    assert {partition_name(m) for m in months} <= await _partitions(db)
    assert await db.fetchval("SELECT count(*) FROM usage_default") == 0
    assert await db.fetchval("SELECT count(*) FROM usage") == len(rows)

    # Kept 90 days: whole months before the cutoff are dropped, older rows of the month it falls in deleted.
    run = await UsageRetention(db, retention_days=90, clock=lambda: NOW).run_once()
    assert run is not None
    cutoff = NOW - dt.timedelta(days=90)
    assert run.dropped and all(next_month(month_start(r.created_at)) <= cutoff for r in rows[:2])
    left = await _partitions(db)
    assert all(next_month(m) > cutoff for m in months if partition_name(m) in left)
    assert partition_name(month_start(rows[0].created_at)) not in left
    kept = sorted(r["job_id"] for r in await db.fetch("SELECT job_id FROM usage"))
    assert kept == sorted(uuid.UUID(r.job_id) for r in rows if r.created_at >= cutoff)
    assert await _rollups(db) == _expected(rows)

    # /admin/usage reports from the rollups, the days whose raw rows are gone included.
    app = FastAPI()
    app.include_router(admin.router)
    app.state.settings = SimpleNamespace(admin_token=SecretStr(ADMIN_TOKEN), batch_billing_factor=0.5)
    app.state.db = db
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        since = (NOW - dt.timedelta(days=400)).date().isoformat()
        answer = await client.get(
            "/admin/usage", params={"since": since}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        keyed = await client.get(
            "/admin/usage",
            params={"since": since, "key_id": "key_a"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
    assert answer.status_code == 200
    expected = sorted(
        (
            {
                "key_id": key,
                "day": day.isoformat(),
                "requests": requests,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "batch_requests": 0,
                "batch_prompt_tokens": 0,
                "batch_completion_tokens": 0,
                # No batch usage: billed as used whatever the factor.
                "billed_tokens": prompt + completion,
            }
            for (day, _tenant, key, _model), (requests, prompt, completion) in _expected(rows).items()
        ),
        key=lambda r: (r["day"], r["key_id"] is None, r["key_id"] or ""),
    )
    assert answer.json() == {"object": "list", "data": expected}
    assert keyed.json()["data"] == [r for r in expected if r["key_id"] == "key_a"]


async def test_rows_moved_into_their_partition_keep_every_column(db) -> None:
    """A batch line's row written while no partition covered its month keeps its `batch` mark."""
    rows = [_row(key="key_b", model="m", age=dt.timedelta(days=70)) for _ in range(2)]
    await _insert(db, rows)
    await db.execute("UPDATE usage SET batch = true WHERE job_id = $1", uuid.UUID(rows[0].job_id))
    assert await db.fetchval("SELECT count(*) FROM usage_default") == 2
    run = await UsageRetention(db, retention_days=365, clock=lambda: NOW).run_once()
    assert run is not None and sum(run.created.values()) == 2
    assert await db.fetchval("SELECT count(*) FROM usage_default") == 0
    moved = {str(r["job_id"]): r["batch"] for r in await db.fetch("SELECT job_id, batch FROM usage")}
    assert moved == {rows[0].job_id: True, rows[1].job_id: False}


async def test_one_session_manager_at_a_time_runs_the_retention(db) -> None:
    retention = UsageRetention(db, retention_days=90)
    async with db.acquire() as holder:
        await holder.execute("SELECT pg_advisory_lock($1)", 0x6178_7572)
        try:
            assert await retention.run_once() is None
        finally:
            await holder.execute("SELECT pg_advisory_unlock($1)", 0x6178_7572)
    assert await retention.run_once() is not None


async def test_the_migration_partitions_a_table_written_before_and_rolls_it_up(
    run_id: str, service_urls, tmp_path: Path
) -> None:
    url = service_urls.postgres.rsplit("/", 1)[0] + f"/axon_test_{run_id}_usage_mig"
    before = tmp_path / "sql"
    before.mkdir()
    for version, path in pending_files():
        if version < "0008":
            shutil.copyfile(Path(str(path)), before / path.name)
    try:
        await migrate(url, migrations_dir=before)
        conn = await asyncpg.connect(url)
        try:
            rows = [_row(key="key_a", model="m", age=dt.timedelta(days=d)) for d in (70, 35, 0)]
            rows.append(_row(key=None, model="m", age=dt.timedelta(days=35)))
            await conn.executemany(
                "INSERT INTO usage (job_id, tenant, key_id, model, prompt_tokens, completion_tokens, created_at)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7)",
                [
                    (
                        uuid.UUID(r.job_id),
                        r.tenant,
                        r.key_id,
                        r.model,
                        r.prompt_tokens,
                        r.completion_tokens,
                        r.created_at,
                    )
                    for r in rows
                ],
            )
            assert (await migrate(url, migrations_dir=DEFAULT_MIGRATIONS_DIR))[0] == "0008_usage_partitions"
            placed = {
                str(r["job_id"]): r["partition"]
                for r in await conn.fetch("SELECT job_id, tableoid::regclass::text AS partition FROM usage")
            }
            assert placed == {r.job_id: partition_name(month_start(r.created_at)) for r in rows}
            first, last = month_start(rows[0].created_at), next_month(month_start(NOW))
            partitions = {
                r["relname"]
                for r in await conn.fetch("SELECT relname FROM pg_class WHERE relname ~ '^usage_[0-9]{6}$'")
            }
            month, wanted = first, set()
            while month <= last:
                wanted.add(partition_name(month))
                month = next_month(month)
            assert partitions == wanted
            sums = await conn.fetch("SELECT * FROM usage_daily")
            assert {
                (r["day"], r["tenant"], r["key_id"], r["model"]): (
                    r["requests"],
                    r["prompt_tokens"],
                    r["completion_tokens"],
                )
                for r in sums
            } == _expected(rows)
            assert await conn.fetchval("SELECT to_regclass('usage_unpartitioned')") is None
        finally:
            await conn.close()
    finally:
        await drop_database(url)
