"""Drains the outbox into PostgreSQL in batches (write-behind).

Every session manager runs one; they share the work through a Redis consumer group.
Entries are acknowledged only after their batch commits, and entries a dead persister
left pending are reclaimed after `reclaim_after_ms`.

A batch crosses from Redis as three strings, not as parsed entries: one Lua script reads
it with XREADGROUP (or XAUTOCLAIM) and returns the entry ids, the messages' COPY lines
already joined, and the usage rows; another acknowledges the ids after the commit and
trims what is settled. Python never handles an entry one by one, which is what kept the
persister well below a plain COPY.
"""

import asyncio
import datetime as dt
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import orjson
import redis.asyncio as redis
from asyncpg.pool import PoolConnectionProxy
from redis.exceptions import ResponseError

from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import MESSAGE_COLUMNS
from shared.logging import get_logger
from shared.names import Names
from shared.outages import Outage

log = get_logger(__name__)

_MESSAGE_COLUMNS = MESSAGE_COLUMNS
_STAGE = "messages_stage"
_CREATE_STAGE = f"CREATE TEMP TABLE {_STAGE} (LIKE messages INCLUDING DEFAULTS) ON COMMIT DROP"
_INSERT_FROM_STAGE = f"""
INSERT INTO messages ({", ".join(_MESSAGE_COLUMNS)})
SELECT {", ".join("t." + c for c in _MESSAGE_COLUMNS)} FROM {_STAGE} t
WHERE EXISTS (SELECT 1 FROM conversations c WHERE c.id = t.conversation_id)
ON CONFLICT DO NOTHING
"""
# A redelivered entry repeats its row's key, (job_id, created_at): skipped, so the trigger that rolls
# inserted rows up into `usage_daily` counts it once.
_INSERT_USAGE = """
INSERT INTO usage (job_id, tenant, key_id, model, prompt_tokens, completion_tokens, latency_ms, created_at, batch)
SELECT * FROM unnest(
    $1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[], $6::int[], $7::int[], $8::timestamptz[], $9::bool[]
)
ON CONFLICT DO NOTHING
"""
# A response committed again (a redelivered batch) or deleted meanwhile (its row a tombstone) is kept as it is.
_INSERT_RESPONSES = """
INSERT INTO responses (id, tenant, body, created_at, expires_at)
SELECT t.id, t.tenant, t.body::jsonb, t.created_at, t.expires_at
FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::timestamptz[])
    AS t(id, tenant, body, created_at, expires_at)
ON CONFLICT (id) DO NOTHING
"""
_DELETE_EXPIRED_RESPONSES = "DELETE FROM responses WHERE expires_at < now()"

# KEYS: outbox. ARGV: group, consumer, count, mode ('new' | 'claim'), min idle ms (claim).
# Returns {space-separated ids, joined COPY lines of the messages, usage rows as JSON, response rows as JSON}.
# No BLOCK (scripts cannot block): an empty outbox is polled every flush interval.
# A message line without `format` (written before messages had tool calls) gets NULL for the
# three columns it lacks, so entries of both formats share one COPY during a rolling upgrade.
_READ = """
local entries
if ARGV[4] == 'claim' then
    entries = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[5], '0-0', 'COUNT', ARGV[3])[2]
else
    local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
    if not reply then return {'', '', {}, {}} end
    entries = reply[1][2]
end
local ids, lines, usage, responses = {}, {}, {}, {}
for _, entry in ipairs(entries) do
    local fields = entry[2]
    if fields then
        ids[#ids + 1] = entry[1]
        local row = {}
        for j = 1, #fields, 2 do row[fields[j]] = fields[j + 1] end
        if row['kind'] == 'response' then
            responses[#responses + 1] = row['row']
        elseif row['kind'] ~= 'message' then
            usage[#usage + 1] = row['row']
        elseif row['format'] then
            lines[#lines + 1] = row['copy']
        else
            lines[#lines + 1] = string.sub(row['copy'], 1, -2) .. '\\t\\\\N\\t\\\\N\\t\\\\N\\n'
        end
    end
end
return {table.concat(ids, ' '), table.concat(lines), usage, responses}
"""

# KEYS: outbox. ARGV: group, space-separated ids.
# XACK the ids, then trim the stream below the oldest entry still pending (or, with none
# pending, up to the last one delivered): never removes an entry that is undelivered or
# unacknowledged, by this persister or any other.
_ACK_AND_TRIM = """
local ids = {}
for id in string.gmatch(ARGV[2], '%S+') do ids[#ids + 1] = id end
for i = 1, #ids, 1000 do
    redis.call('XACK', KEYS[1], ARGV[1], unpack(ids, i, math.min(i + 999, #ids)))
end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1])
local floor = pending[2]
if pending[1] == 0 then
    for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
        local fields = {}
        for j = 1, #group, 2 do fields[group[j]] = group[j + 1] end
        if fields['name'] == ARGV[1] then
            local ms, seq = string.match(fields['last-delivered-id'], '^(%d+)-(%d+)$')
            floor = ms .. '-' .. string.format('%d', tonumber(seq) + 1)
        end
    end
end
return redis.call('XTRIM', KEYS[1], 'MINID', floor)
"""


@dataclass(frozen=True, slots=True)
class Batch:
    """Outbox entries read together: their ids, the messages as COPY text, the usage rows, the
    stored responses."""

    ids: bytes
    copy_text: bytes
    usage: list[bytes]
    responses: list[bytes] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.ids.count(b" ") + 1


class Persister:
    """One consumer of the outbox's consumer group.

    `run()` drains until `stop()`: stopping is a flag, not a task cancellation, because
    redis-py may swallow a cancellation that lands mid-command (redis/redis-py#2028).
    """

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
        concurrency: int = 1,
        commit_timeout_s: float = 30.0,
    ) -> None:
        self._redis = client
        self._db = db
        self._names = names
        self._metrics = metrics
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_ms / 1000
        self._reclaim_after_ms = reclaim_after_ms
        self._concurrency = concurrency
        self._commit_timeout_s = commit_timeout_s
        self._read_script = client.register_script(_READ)
        self._ack_and_trim_script = client.register_script(_ACK_AND_TRIM)
        self._stopping = asyncio.Event()
        self.consumer = f"persister-{uuid.uuid4().hex[:12]}"

    async def ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(self._names.outbox, self._names.outbox_group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def stop(self) -> None:
        """Ask `run()` to return: no new batch is read, batches being committed finish (one
        still failing is left pending, for a live persister to reclaim)."""
        self._stopping.set()

    async def run(self) -> None:
        """Drain until `stop()`: one task reads batches while `concurrency` tasks commit
        them, each on its own connection. Failures (Redis or PostgreSQL down) only delay
        persistence: the reader and each committer retry on their own, a committer with the
        batch it holds."""
        batches: asyncio.Queue[Batch | None] = asyncio.Queue(maxsize=1)
        async with asyncio.TaskGroup() as group:
            group.create_task(self._read_into(batches))
            for _ in range(self._concurrency):
                group.create_task(self._persist_from(batches))

    async def _read_into(self, batches: asyncio.Queue[Batch | None]) -> None:
        next_reclaim = 0.0
        grouped = False
        outage = Outage("persister_read")
        while not self._stopping.is_set():
            try:
                if not grouped:
                    await self.ensure_group()  # again after a failure: Redis may have lost the stream
                    grouped = True
                batch = None
                if time.monotonic() >= next_reclaim:
                    batch = await self._read("claim")
                    next_reclaim = time.monotonic() + self._reclaim_after_ms / 1000 / 2
                    if batch is not None:
                        log.info("outbox_reclaimed", entries=batch.size)
                batch = batch or await self._read("new")
            except Exception as exc:  # noqa: BLE001 - keep reading once Redis is back
                grouped = False
                await self._pause(outage.failed(exc))
                continue
            outage.recovered()
            if batch is None:
                await self._pause(self._flush_interval_s)
            else:
                await batches.put(batch)
        for _ in range(self._concurrency):
            await batches.put(None)

    async def _persist_from(self, batches: asyncio.Queue[Batch | None]) -> None:
        outage = Outage("persister")
        while (batch := await batches.get()) is not None:
            while True:
                try:
                    async with asyncio.timeout(self._commit_timeout_s):
                        await self._persist(batch)
                    outage.recovered()
                    break
                except Exception as exc:  # noqa: BLE001 - keep the batch until PostgreSQL is back
                    delay = outage.failed(exc, entries=batch.size)
                    if self._stopping.is_set():
                        break  # left pending: a live persister reclaims it
                    await self._pause(delay)

    async def _pause(self, seconds: float) -> None:
        """Sleep, waking early on `stop()`."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def _read(self, mode: str) -> Batch | None:
        """The next batch: new entries, or (`claim`) entries another persister left pending."""
        ids, copy_text, usage, responses = await self._read_script(
            keys=[self._names.outbox],
            args=[self._names.outbox_group, self.consumer, self._batch_size, mode, self._reclaim_after_ms],
        )
        return Batch(ids, copy_text, usage, responses) if ids else None

    async def _commit(self, batch: Batch) -> None:
        """One transaction per batch. If any message is already there (a redelivered batch) or
        its session was deleted meanwhile, the batch is written again, skipping those rows."""
        started = time.perf_counter()
        async with self._db.acquire() as conn:
            try:
                async with conn.transaction():
                    await _write(conn, batch, skip_existing=False)
            except (asyncpg.UniqueViolationError, asyncpg.ForeignKeyViolationError):
                async with conn.transaction():
                    await _write(conn, batch, skip_existing=True)
        self._metrics.persisted_rows.inc(batch.size)
        self._metrics.persist_batch_size.observe(batch.size)
        self._metrics.persist_duration.observe(time.perf_counter() - started)

    async def _persist(self, batch: Batch) -> None:
        """Commit, then acknowledge the entries and trim what is settled (a crash in between
        only rewrites them)."""
        await self._commit(batch)
        await self._ack_and_trim_script(keys=[self._names.outbox], args=[self._names.outbox_group, batch.ids])


async def _write(conn: PoolConnectionProxy, batch: Batch, *, skip_existing: bool) -> None:
    """COPY the messages' lines straight into the table (the fast path) or, to skip rows
    already there or of deleted sessions, into a staging table to insert from."""
    if batch.copy_text:
        source = memoryview(batch.copy_text)  # a buffer: asyncpg would take bytes for a path
        if skip_existing:
            await conn.execute(_CREATE_STAGE)
            await conn.copy_to_table(
                _STAGE,
                source=source,  # type: ignore[arg-type]  # asyncpg takes a buffer (documented); its stubs omit it
                columns=_MESSAGE_COLUMNS,
                format="text",
            )
            await conn.execute(_INSERT_FROM_STAGE)
        else:
            await conn.copy_to_table(
                "messages",
                source=source,  # type: ignore[arg-type]  # asyncpg takes a buffer (documented); its stubs omit it
                columns=_MESSAGE_COLUMNS,
                format="text",
            )
    if batch.responses:
        await conn.execute(_INSERT_RESPONSES, *_response_columns([orjson.loads(row) for row in batch.responses]))
        await conn.execute(_DELETE_EXPIRED_RESPONSES)
    if batch.usage:
        # Last: its trigger adds the new rows to `usage_daily`, whose rows other batches of the same
        # key, model and day wait for until this transaction commits.
        await conn.execute(_INSERT_USAGE, *_usage_columns([orjson.loads(row) for row in batch.usage]))


def _usage_columns(rows: list[dict[str, Any]]) -> list[list[object]]:
    return [
        [uuid.UUID(r["job_id"]) for r in rows],
        [r["tenant"] for r in rows],
        [r["key_id"] for r in rows],
        [r["model"] for r in rows],
        [r["prompt_tokens"] for r in rows],
        [r["completion_tokens"] for r in rows],
        [r["latency_ms"] for r in rows],
        [dt.datetime.fromisoformat(r["created_at"]) for r in rows],
        # An entry written before batches existed has no `batch`.
        [r.get("batch", False) for r in rows],
    ]


def _response_columns(rows: list[dict[str, Any]]) -> list[list[object]]:
    return [
        [r["id"] for r in rows],
        [r["tenant"] for r in rows],
        [orjson.dumps(r["body"]).decode() for r in rows],
        [dt.datetime.fromisoformat(r["created_at"]) for r in rows],
        [dt.datetime.fromisoformat(r["expires_at"]) for r in rows],
    ]
