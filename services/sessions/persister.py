"""Drains the outbox into PostgreSQL in batches (write-behind).

Every session manager runs one; they share the work through a Redis consumer group.
Entries are acknowledged only after their batch commits, and entries a dead persister
left pending are reclaimed after `reclaim_after_ms`.
"""

import asyncio
import datetime as dt
import io
import time
import uuid

import asyncpg
import redis.asyncio as redis
from redis.exceptions import ResponseError

from shared.logging import get_logger
from shared.names import Names
from shared.outbox import decode_entry
from services.sessions.metrics import SessionsMetrics

log = get_logger(__name__)

_INSERT_MESSAGES = """
INSERT INTO messages (id, conversation_id, seq, role, content, status, job_id, created_at)
SELECT t.* FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::text[], $5::text[], $6::text[], $7::uuid[], $8::timestamptz[])
  AS t(id, conversation_id, seq, role, content, status, job_id, created_at)
WHERE EXISTS (SELECT 1 FROM conversations c WHERE c.id = t.conversation_id)
ON CONFLICT DO NOTHING
"""
_MESSAGE_COLUMNS = ("id", "conversation_id", "seq", "role", "content", "status", "job_id", "created_at")
_INSERT_USAGE = """
INSERT INTO usage (job_id, tenant, key_id, model, prompt_tokens, completion_tokens, latency_ms, created_at)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[], $6::int[], $7::int[], $8::timestamptz[])
ON CONFLICT DO NOTHING
"""
_RETRY_DELAY_S = 1.0


def _ts(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value)


class Persister:
    """One consumer of the outbox's consumer group."""

    def __init__(
        self,
        *,
        client: redis.Redis,
        db: asyncpg.Pool,
        names: Names,
        metrics: SessionsMetrics,
        batch_size: int,
        flush_interval_ms: int,
        reclaim_after_ms: int,
    ) -> None:
        self._redis = client
        self._db = db
        self._names = names
        self._metrics = metrics
        self._batch_size = batch_size
        self._flush_interval_ms = flush_interval_ms
        self._reclaim_after_ms = reclaim_after_ms
        self.consumer = f"persister-{uuid.uuid4().hex[:12]}"

    async def ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(self._names.outbox, self._names.outbox_group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run(self) -> None:
        """Drain forever; failures (Redis or PostgreSQL down) only delay persistence.

        The next batch is read while the current one commits.
        """
        while True:
            try:
                await self.ensure_group()
                await self._drain_forever()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep draining once the dependency is back
                log.warning("persister_failed", error=repr(exc))
                await asyncio.sleep(_RETRY_DELAY_S)

    async def _drain_forever(self) -> None:
        next_reclaim = 0.0
        reading = asyncio.create_task(self._read())
        try:
            while True:
                entries = await reading
                reading = asyncio.create_task(self._read())
                if time.monotonic() >= next_reclaim:
                    entries += await self._reclaim()
                    next_reclaim = time.monotonic() + self._reclaim_after_ms / 1000 / 2
                await self._drain(entries)
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    async def _read(self) -> list[tuple[bytes, dict]]:
        response = await self._redis.xreadgroup(
            self._names.outbox_group, self.consumer, {self._names.outbox: ">"},
            count=self._batch_size, block=self._flush_interval_ms,
        )  # fmt: skip
        return response[0][1] if response else []

    async def _reclaim(self) -> list[tuple[bytes, dict]]:
        """Take over entries another persister read but never acknowledged."""
        _next, entries, _deleted = await self._redis.xautoclaim(
            self._names.outbox, self._names.outbox_group, self.consumer,
            min_idle_time=self._reclaim_after_ms, start_id="0-0", count=self._batch_size,
        )  # fmt: skip
        if entries:
            log.info("outbox_reclaimed", entries=len(entries))
        return [(entry_id, fields) for entry_id, fields in entries if fields]

    async def _drain(self, entries: list[tuple[bytes, dict]]) -> None:
        if not entries:
            return
        message_entries = [fields for _id, fields in entries if fields[b"kind"] == b"message"]
        usage = [decode_entry(fields)[1] for _id, fields in entries if fields[b"kind"] == b"usage"]
        started = time.perf_counter()
        async with self._db.acquire() as conn, conn.transaction():
            if message_entries:
                await _write_messages(conn, message_entries)
            if usage:
                await conn.execute(_INSERT_USAGE, *_usage_columns(usage))
        ids = [entry_id for entry_id, _ in entries]
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xack(self._names.outbox, self._names.outbox_group, *ids)
            pipe.xdel(self._names.outbox, *ids)
            await pipe.execute()
        self._metrics.persisted_rows.inc(len(entries))
        self._metrics.persist_batch_size.observe(len(entries))
        self._metrics.persist_duration.observe(time.perf_counter() - started)


async def _write_messages(conn: asyncpg.Connection, entries: list[dict[bytes, bytes]]) -> None:
    """COPY the batch's pre-rendered lines (the fast path); if any row is already there (a
    redelivered batch) or its session was deleted meanwhile, insert skipping those rows."""
    try:
        async with conn.transaction():
            await conn.copy_to_table(
                "messages", source=io.BytesIO(b"".join(f[b"copy"] for f in entries)),
                columns=_MESSAGE_COLUMNS, format="text",
            )  # fmt: skip
    except (asyncpg.UniqueViolationError, asyncpg.ForeignKeyViolationError):
        rows = [decode_entry(f)[1] for f in entries]
        await conn.execute(_INSERT_MESSAGES, *_message_columns(rows))


def _message_columns(rows: list[dict]) -> list[list]:
    return [
        [uuid.UUID(r["id"]) for r in rows],
        [uuid.UUID(r["conversation_id"]) for r in rows],
        [r["seq"] for r in rows],
        [r["role"] for r in rows],
        [r["content"] for r in rows],
        [r["status"] for r in rows],
        [uuid.UUID(r["job_id"]) if r.get("job_id") else None for r in rows],
        [_ts(r["created_at"]) for r in rows],
    ]


def _usage_columns(rows: list[dict]) -> list[list]:
    return [
        [uuid.UUID(r["job_id"]) for r in rows],
        [r["tenant"] for r in rows],
        [r["key_id"] for r in rows],
        [r["model"] for r in rows],
        [r["prompt_tokens"] for r in rows],
        [r["completion_tokens"] for r in rows],
        [r["latency_ms"] for r in rows],
        [_ts(r["created_at"]) for r in rows],
    ]
