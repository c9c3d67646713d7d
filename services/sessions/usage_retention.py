"""Keeps PostgreSQL's `usage` table bounded (`shared/migrations/sql/0008_usage_partitions.sql`).

The table is partitioned by month of `created_at` (UTC), `usage_YYYYMM`, with `usage_default`
for rows no partition covers; `usage_daily` keeps the per-day rollups that `/admin/usage` reads,
maintained by a trigger as rows are inserted. Every session manager runs this task every
`RUN_EVERY_S` (and once at start); an advisory lock lets one of them at a time do the work:

1. A partition for this month and the next, and for any month whose rows `usage_default` holds
   (written while no partition covered them) and that is still within the retention: those rows
   are moved into it, in the same transaction as it is created and attached.
2. Every partition whose whole month is older than the retention is dropped.
3. The raw rows older than the retention that are left (in the partition the cutoff falls in, and
   in `usage_default`) are deleted.

Rollups are never touched: reports outlive the raw rows.
"""

import asyncio
import datetime as dt
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from shared.logging import get_logger

log = get_logger(__name__)

RUN_EVERY_S = 3600.0
# Distinct from the migrator's key ("axon"): "axur".
_LOCK_KEY = 0x6178_7572
# A partition created or dropped waits at most this long for the locks it needs (persisters
# inserting), then gives up until the next run rather than holding writes back.
_LOCK_TIMEOUT = "5s"
_PARTITION = re.compile(r"usage_([0-9]{4})([0-9]{2})")
# Every column of `usage`: a row moved into its partition keeps them all (`batch` included).
_COLUMNS = "job_id, tenant, model, prompt_tokens, completion_tokens, created_at, key_id, latency_ms, batch"


@dataclass(slots=True)
class RetentionRun:
    """What one run did: partitions created (with the rows moved into each) and dropped, and the
    rows deleted from the partition the cutoff falls in and from `usage_default`."""

    cutoff: dt.datetime
    created: dict[str, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    deleted_rows: int = 0


def month_start(moment: dt.datetime) -> dt.datetime:
    """The first instant (UTC) of the month `moment` falls in."""
    utc = moment.astimezone(dt.UTC)
    return dt.datetime(utc.year, utc.month, 1, tzinfo=dt.UTC)


def next_month(month: dt.datetime) -> dt.datetime:
    return dt.datetime(month.year + month.month // 12, month.month % 12 + 1, 1, tzinfo=dt.UTC)


def partition_name(month: dt.datetime) -> str:
    return f"usage_{month:%Y%m}"


class UsageRetention:
    """Runs the retention of raw usage rows (see the module's docstring)."""

    def __init__(
        self,
        db: asyncpg.Pool,
        *,
        retention_days: int,
        interval_s: float = RUN_EVERY_S,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self._db = db
        self._retention = dt.timedelta(days=retention_days)
        self._interval_s = interval_s
        self._clock = clock

    async def run(self) -> None:
        """Run now and then every `interval_s` until cancelled; a failed run (PostgreSQL down, a
        lock not granted in time) is logged and tried again at the next."""
        while True:
            try:
                await self.run_once()
            except Exception as exc:  # noqa: BLE001 - retried at the next run
                log.warning("usage_retention_failed", error=repr(exc))
            await asyncio.sleep(self._interval_s)

    async def run_once(self) -> RetentionRun | None:
        """One run; None when another process holds the lock (it is doing the same work)."""
        now = self._clock()
        cutoff = now - self._retention
        async with self._db.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", _LOCK_KEY):
                return None
            try:
                done = RetentionRun(cutoff=cutoff)
                await _create_partitions(conn, now, cutoff, done)
                await _drop_partitions(conn, cutoff, done)
                status = await conn.execute("DELETE FROM usage WHERE created_at < $1", cutoff)
                done.deleted_rows = int(status.split()[-1])
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
        if done.deleted_rows:
            log.info("usage_rows_deleted", rows=done.deleted_rows, cutoff=cutoff.isoformat())
        return done


async def _partitions(conn: PoolConnectionProxy) -> dict[dt.datetime, str]:
    """The monthly partitions of `usage`, by the first instant of their month."""
    rows = await conn.fetch(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'usage'::regclass"
    )
    found = {}
    for row in rows:
        if match := _PARTITION.fullmatch(row["relname"]):
            found[dt.datetime(int(match[1]), int(match[2]), 1, tzinfo=dt.UTC)] = row["relname"]
    return found


async def _create_partitions(
    conn: PoolConnectionProxy, now: dt.datetime, cutoff: dt.datetime, done: RetentionRun
) -> None:
    this_month = month_start(now)
    wanted = {this_month, next_month(this_month)}
    stray = await conn.fetch(
        "SELECT DISTINCT date_trunc('month', created_at AT TIME ZONE 'UTC') AS month FROM usage_default"
    )
    wanted |= {m for row in stray if next_month(m := row["month"].replace(tzinfo=dt.UTC)) > cutoff}
    existing = await _partitions(conn)
    for month in sorted(wanted - existing.keys()):
        name, end = partition_name(month), next_month(month)
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{_LOCK_TIMEOUT}'")
            await conn.execute(f"CREATE TABLE {name} (LIKE usage INCLUDING DEFAULTS)")
            status = await conn.execute(
                f"WITH moved AS (DELETE FROM usage_default WHERE created_at >= $1 AND created_at < $2"
                f" RETURNING {_COLUMNS}) INSERT INTO {name} ({_COLUMNS}) SELECT {_COLUMNS} FROM moved",
                month,
                end,
            )
            await conn.execute(
                f"ALTER TABLE usage ATTACH PARTITION {name}"
                f" FOR VALUES FROM ('{month.isoformat()}') TO ('{end.isoformat()}')"
            )
        done.created[name] = int(status.split()[-1])
        log.info("usage_partition_created", partition=name, moved_rows=done.created[name])


async def _drop_partitions(conn: PoolConnectionProxy, cutoff: dt.datetime, done: RetentionRun) -> None:
    for month, name in sorted((await _partitions(conn)).items()):
        if next_month(month) <= cutoff:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{_LOCK_TIMEOUT}'")
                await conn.execute(f"DROP TABLE {name}")
            done.dropped.append(name)
            log.info("usage_partition_dropped", partition=name)
