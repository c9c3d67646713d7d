"""Batches and their lines in PostgreSQL (`batches`, `batch_lines`: migration 0010).

A batch's row moves through OpenAI's statuses by compare-and-set (`transition`: only from the
statuses named), so a cancel and its owner's progress never overwrite each other. A line's answer
is set only while it has none, in the statement that counts it (`answer`), so each line is answered
and counted exactly once whichever session manager answers it.

Anthropic's Message Batches (`/v1/messages/batches`) are batches too, of endpoint
`MESSAGES_ENDPOINT`: created with their lines at once (`create_filled`: the requests come in the
body, not in a file), listed apart from OpenAI's (`message_page`, `page`), their never-run lines
counted in `unrun` as well as `failed`, and deleted on request once ended (`delete_ended`).

Every batch belongs to the deployment (`AXON_NAMESPACE`) that created it: deployments sharing the
database never see, lease, list or sweep each other's batches (migration 0012); a batch's lines are
reached only through their batch.

An ended batch's lines (their request bodies and answers) are deleted once it ends: its output and
error files hold the answers (`forget_lines`, and `sweep` for a batch whose owner died before it
could); an ended batch's row is deleted `AXON_BATCH_RETENTION_DAYS` after it was created.
"""

import asyncio
import datetime as dt
import hashlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson

from services.sessions.batches.validation import BatchLine
from shared.postgres_text import postgres_text

# The endpoint of Anthropic's Message Batches' lines.
MESSAGES_ENDPOINT = "/v1/messages"
# Statuses a batch ends in.
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
# Statuses an owner still has work in.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
# Lines written per COPY while a file is validated.
_COPY_ROWS = 1000
# Batches one sweep statement deletes (the lines of) at most: the next takes the rest.
_SWEEP_BATCHES = 10


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """A batch's row."""

    id: str
    tenant: str
    key_id: str | None
    endpoint: str
    input_file_id: str | None
    completion_window: str
    status: str
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None
    output_file_id: str | None
    error_file_id: str | None
    total: int
    completed: int
    failed: int
    created_at: dt.datetime
    expires_at: dt.datetime
    in_progress_at: dt.datetime | None = None
    finalizing_at: dt.datetime | None = None
    completed_at: dt.datetime | None = None
    failed_at: dt.datetime | None = None
    expired_at: dt.datetime | None = None
    cancelling_at: dt.datetime | None = None
    cancelled_at: dt.datetime | None = None
    # Of `failed`: the lines never run (the batch was cancelled or expired first).
    unrun: int = 0

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


# A model for which a key's unanswered lines (of its batches in progress in namespace $3, and
# `mine`) count more than (`op`) $2 tokens. $1: the key.
_OVER_QUEUE = (
    "SELECT l.model, sum(l.tokens) AS tokens FROM batch_lines l JOIN batches b ON b.id = l.batch_id"
    " WHERE b.key_id = $1 AND b.namespace = $3 AND l.result IS NULL"
    " AND (b.status IN ('in_progress', 'cancelling') {mine})"
    " GROUP BY l.model HAVING sum(l.tokens) {op} $2 ORDER BY l.model LIMIT 1"
)


class QueueFull(Exception):
    """A key's batch queue for `model` holds `tokens` tokens, past its limit `limit`."""

    def __init__(self, model: str, tokens: int, limit: int) -> None:
        super().__init__(model, tokens, limit)
        self.model, self.tokens, self.limit = model, tokens, limit

    @property
    def message(self) -> str:
        return (
            f"Enqueued token limit reached for {self.model}: this key's batches would hold {self.tokens} tokens"
            f" for it, more than its limit of {self.limit}; try again once its batches have run."
        )


@dataclass(frozen=True, slots=True)
class PendingLine:
    """A line not answered yet."""

    line: int
    custom_id: str
    model: str
    body: str


def line_request_id(batch_id: str, line: int) -> str:
    """The id of a line's output (`batch_req_<hex>`): the same whichever process answers it."""
    digest = hashlib.md5(f"{batch_id}:{line}".encode(), usedforsecurity=False).hexdigest()
    return "batch_req_" + digest  # as `answer_rest` names them in SQL


def _record(row: asyncpg.Record) -> BatchRecord:
    values = dict(row)
    for name in ("metadata", "errors"):
        if values[name] is not None:
            values[name] = orjson.loads(values[name])
    return BatchRecord(**values)


_COLUMNS = ", ".join(BatchRecord.__dataclass_fields__)


class BatchStore:
    """The batches of deployment `namespace`, and their lines (see the module's docstring)."""

    def __init__(self, pool: asyncpg.Pool, *, namespace: str) -> None:
        self._pool = pool
        self._namespace = namespace

    async def create(self, record: BatchRecord) -> None:
        await self._insert(self._pool, record)

    async def _insert(self, conn: Any, record: BatchRecord) -> None:
        await conn.execute(
            "INSERT INTO batches (id, tenant, key_id, endpoint, input_file_id, completion_window, status, metadata,"
            " created_at, expires_at, in_progress_at, total, namespace)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9, $10, $11, $12, $13)",
            record.id,
            record.tenant,
            record.key_id,
            record.endpoint,
            record.input_file_id,
            record.completion_window,
            record.status,
            orjson.dumps(record.metadata).decode() if record.metadata is not None else None,
            record.created_at,
            record.expires_at,
            record.in_progress_at,
            record.total,
            self._namespace,
        )

    async def create_filled(self, record: BatchRecord, lines: list[BatchLine], *, queue_tokens: int) -> None:
        """Store batch `record` (`in_progress`, its `total` the number of `lines`) with its lines, in
        one transaction: all of it, or (the key's batch queue is full) nothing.

        Raises:
            QueueFull: with these lines, the batch's key would have more than `queue_tokens` (0: no
                limit) tokens enqueued for a model.
        """
        async with self._pool.acquire() as conn, conn.transaction():
            await self._insert(conn, record)
            for start in range(0, len(lines), _COPY_ROWS):
                rows = [
                    (record.id, x.line, x.custom_id, x.model, x.body, x.tokens)
                    for x in lines[start : start + _COPY_ROWS]
                ]
                await _copy(conn, rows)
            await self._check_queue(conn, record.id, key_id=record.key_id, queue_tokens=queue_tokens)

    async def load(self, batch_id: str) -> BatchRecord | None:
        """Any tenant's batch of this deployment (its owner's view)."""
        row = await self._pool.fetchrow(
            f"SELECT {_COLUMNS} FROM batches WHERE id = $1 AND namespace = $2", batch_id, self._namespace
        )
        return _record(row) if row is not None else None

    async def get(self, tenant: str, batch_id: str) -> BatchRecord | None:
        """The tenant's batch, or None (unknown, or another tenant's)."""
        row = await self._pool.fetchrow(
            f"SELECT {_COLUMNS} FROM batches WHERE id = $1 AND tenant = $2 AND namespace = $3",
            batch_id,
            tenant,
            self._namespace,
        )
        return _record(row) if row is not None else None

    async def page(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """The tenant's OpenAI batches, newest first, after batch `after` (None: from the newest);
        and whether more follow."""
        records, has_more = await self._page(tenant, messages=False, older_than=after, newer_than=None, limit=limit)
        return records, has_more

    async def message_page(
        self, tenant: str, *, after_id: str | None, before_id: str | None, limit: int
    ) -> tuple[list[BatchRecord], bool]:
        """The tenant's message batches, newest first, as Anthropic pages them: those listed after
        batch `after_id` (older), or before batch `before_id` (newer: the `limit` nearest it), or
        between both; and whether more follow on the side paged towards."""
        return await self._page(tenant, messages=True, older_than=after_id, newer_than=before_id, limit=limit)

    async def _page(
        self, tenant: str, *, messages: bool, older_than: str | None, newer_than: str | None, limit: int
    ) -> tuple[list[BatchRecord], bool]:
        """Up to `limit` of the tenant's batches (message batches, or the others) older than batch
        `older_than` and newer than batch `newer_than` (an unknown one: none), nearest to
        `newer_than` if only it is given, else the newest; newest first; and whether more follow."""
        towards_newer = newer_than is not None and older_than is None
        conditions = ["namespace = $1", "tenant = $2", "(endpoint = $3) = $4"]
        args: list[Any] = [self._namespace, tenant, MESSAGES_ENDPOINT, messages]
        for cursor, side in ((older_than, "<"), (newer_than, ">")):
            if cursor is not None:
                args.append(cursor)
                conditions.append(
                    f"(created_at, id) {side} (SELECT created_at, id FROM batches"
                    f" WHERE id = ${len(args)} AND tenant = $2 AND namespace = $1)"
                )
        args.append(limit + 1)
        order = "ASC" if towards_newer else "DESC"
        rows = await self._pool.fetch(
            f"SELECT {_COLUMNS} FROM batches WHERE {' AND '.join(conditions)}"
            f" ORDER BY created_at {order}, id {order} LIMIT ${len(args)}",
            *args,
        )
        records = [_record(r) for r in rows[:limit]]
        return (records[::-1] if towards_newer else records), len(rows) > limit

    async def recent(self, *, tenant: str | None, limit: int) -> "list[BatchRecord]":
        """The newest batches (of `tenant`, or of every tenant), newest first."""
        rows = await self._pool.fetch(
            f"SELECT {_COLUMNS} FROM batches WHERE namespace = $3 AND ($1::text IS NULL OR tenant = $1)"
            " ORDER BY created_at DESC, id DESC LIMIT $2",
            tenant,
            limit,
            self._namespace,
        )
        return [_record(r) for r in rows]

    async def transition(self, batch_id: str, to: str, *, from_: Iterable[str], **fields: Any) -> BatchRecord | None:
        """Set the batch's status to `to` (and `<to>_at` to now, and `fields`) if it is one of
        `from_`; the batch as it is then, or None if it was not."""
        values: dict[str, Any] = {f"{to}_at": dt.datetime.now(dt.UTC), **fields}
        if "errors" in values:
            values["errors"] = _jsonb(values["errors"])
        sets = ", ".join(
            f"{name} = ${i}" + ("::jsonb" if name == "errors" else "") for i, name in enumerate(values, start=4)
        )
        row = await self._pool.fetchrow(
            f"UPDATE batches SET status = $2, {sets} WHERE id = $1 AND status = ANY($3::text[])"
            f" AND namespace = ${len(values) + 4} RETURNING {_COLUMNS}",
            batch_id,
            to,
            list(from_),
            *values.values(),
            self._namespace,
        )
        return _record(row) if row is not None else None

    async def validated(
        self, batch_id: str, lines: AsyncIterator[BatchLine], *, key_id: str | None, queue_tokens: int
    ) -> int:
        """Store the batch's `lines` as it validates them, in one transaction: all of them or (the
        iteration raised, or the key's batch queue is full) none. Lines stored by an earlier
        attempt (its owner died) are replaced. Returns how many were stored.

        Raises:
            QueueFull: with these lines, key `key_id` would have more than `queue_tokens` (0: no
                limit) tokens enqueued for a model.
        """
        total = 0
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM batch_lines WHERE batch_id = $1", batch_id)
            # One COPY of `_COPY_ROWS` lines runs while the next ones are read and checked.
            copying: asyncio.Task[int] | None = None
            rows: list[tuple[str, int, str, str, str, int]] = []
            try:
                async for line in lines:
                    rows.append((batch_id, line.line, line.custom_id, line.model, line.body, line.tokens))
                    if len(rows) >= _COPY_ROWS:
                        total += await copying if copying is not None else 0
                        copying, rows = asyncio.create_task(_copy(conn, rows)), []
            except BaseException:
                # The transaction ends only once its connection is idle again.
                if copying is not None:
                    await asyncio.gather(copying, return_exceptions=True)
                raise
            total += await copying if copying is not None else 0
            total += await _copy(conn, rows)
            await self._check_queue(conn, batch_id, key_id=key_id, queue_tokens=queue_tokens)
            await conn.execute("UPDATE batches SET total = $2 WHERE id = $1", batch_id, total)
        return total

    async def _check_queue(self, conn: Any, batch_id: str, *, key_id: str | None, queue_tokens: int) -> None:
        """Raises: QueueFull, with batch `batch_id`'s lines (stored in this transaction) key `key_id`
        has more than `queue_tokens` (0: no limit) tokens enqueued for a model."""
        if key_id is None or not queue_tokens:
            return
        # One batch of a key checked at a time: each sees the lines of those committed before.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('axon-batch-queue:' || $1))", key_id)
        over = await conn.fetchrow(
            _OVER_QUEUE.format(mine="OR b.id = $4", op=">"), key_id, queue_tokens, self._namespace, batch_id
        )
        if over is not None:
            raise QueueFull(over["model"], int(over["tokens"]), queue_tokens)

    async def queue_full(self, key_id: str, queue_tokens: int) -> "QueueFull | None":
        """Whether key `key_id` has `queue_tokens` or more tokens enqueued for a model already."""
        over = await self._pool.fetchrow(_OVER_QUEUE.format(mine="", op=">="), key_id, queue_tokens, self._namespace)
        return QueueFull(over["model"], int(over["tokens"]), queue_tokens) if over is not None else None

    async def unanswered(self, batch_id: str, *, after_line: int, limit: int) -> list[PendingLine]:
        """Up to `limit` unanswered lines past `after_line`, in order."""
        rows = await self._pool.fetch(
            "SELECT line, custom_id, model, body FROM batch_lines WHERE batch_id = $1 AND result IS NULL"
            " AND line > $2 ORDER BY line LIMIT $3",
            batch_id,
            after_line,
            limit,
        )
        return [PendingLine(r["line"], r["custom_id"], r["model"], r["body"]) for r in rows]

    async def answer(self, batch_id: str, line: int, *, ok: bool, result: dict[str, Any]) -> bool:
        """Record line `line`'s output (`ok`) or error line, and count it, unless it was answered
        already; whether this answered it."""
        counted = "completed" if ok else "failed"
        answered = await self._pool.fetchval(
            "WITH done AS (UPDATE batch_lines SET ok = $3, result = $4::jsonb"
            " WHERE batch_id = $1 AND line = $2 AND result IS NULL RETURNING 1)"
            f" UPDATE batches SET {counted} = {counted} + (SELECT count(*) FROM done) WHERE id = $1"
            " RETURNING (SELECT count(*) FROM done)",
            batch_id,
            line,
            ok,
            _jsonb(result),
        )
        return bool(answered)

    async def answer_rest(self, batch_id: str, *, code: str, message: str) -> int:
        """Answer every unanswered line with OpenAI's error `code` (the batch expired or was
        cancelled), counted failed and unrun; how many."""
        result = (
            "jsonb_build_object('id', 'batch_req_' || md5(batch_id || ':' || line), 'custom_id', custom_id,"
            " 'response', null, 'error', jsonb_build_object('code', $2::text, 'message', $3::text))"
        )
        return await self._answer_rest(batch_id, result, code, message)

    async def answer_rest_as_messages(self, batch_id: str, *, result_type: str) -> int:
        """Answer every unanswered line of a message batch as Anthropic's `result_type` (`canceled`
        or `expired`), counted failed and unrun; how many."""
        result = "jsonb_build_object('custom_id', custom_id, 'result', jsonb_build_object('type', $2::text))"
        return await self._answer_rest(batch_id, result, result_type)

    async def _answer_rest(self, batch_id: str, result: str, *args: str) -> int:
        return int(
            await self._pool.fetchval(
                f"WITH done AS (UPDATE batch_lines SET ok = false, result = {result}"
                " WHERE batch_id = $1 AND result IS NULL RETURNING 1)"
                " UPDATE batches SET failed = failed + (SELECT count(*) FROM done),"
                " unrun = unrun + (SELECT count(*) FROM done) WHERE id = $1"
                " RETURNING (SELECT count(*) FROM done)",
                batch_id,
                *args,
            )
            or 0
        )

    async def results(self, batch_id: str, *, ok: bool | None) -> AsyncIterator[bytes]:
        """The batch's output lines (`ok`), error lines (not `ok`) or every answered line (None), in
        line order, as JSONL pieces, read through a cursor so a 50,000-line batch is never in
        memory whole."""
        async with self._pool.acquire() as conn, conn.transaction():
            piece: list[bytes] = []
            query = (
                "SELECT result::text FROM batch_lines WHERE batch_id = $1 AND result IS NOT NULL"
                " AND ($2::boolean IS NULL OR ok = $2) ORDER BY line"
            )
            async for row in conn.cursor(query, batch_id, ok, prefetch=500):
                piece.append(row[0].encode() + b"\n")
                if len(piece) >= 500:
                    yield b"".join(piece)
                    piece.clear()
            if piece:
                yield b"".join(piece)

    async def delete_ended(self, tenant: str, batch_id: str) -> BatchRecord | None:
        """Delete the tenant's batch `batch_id` (and its lines) if it has ended; as it was, or None
        if it was not deleted (see `get` for why)."""
        row = await self._pool.fetchrow(
            f"DELETE FROM batches WHERE id = $1 AND tenant = $2 AND namespace = $3 AND status = ANY($4::text[])"
            f" RETURNING {_COLUMNS}",
            batch_id,
            tenant,
            self._namespace,
            list(TERMINAL),
        )
        return _record(row) if row is not None else None

    async def set_files(self, batch_id: str, *, output_file_id: str | None, error_file_id: str | None) -> None:
        await self._pool.execute(
            "UPDATE batches SET output_file_id = $2, error_file_id = $3 WHERE id = $1",
            batch_id,
            output_file_id,
            error_file_id,
        )

    async def waiting(self) -> list[tuple[str, int, dt.datetime]]:
        """Per model: the unanswered lines of running batches, and when the oldest of those
        batches went `in_progress`."""
        rows = await self._pool.fetch(
            "SELECT l.model, count(*) AS lines, min(b.in_progress_at) AS since FROM batch_lines l"
            " JOIN batches b ON b.id = l.batch_id WHERE l.result IS NULL AND b.status = 'in_progress'"
            " AND b.namespace = $1 GROUP BY l.model",
            self._namespace,
        )
        return [(r["model"], r["lines"], r["since"]) for r in rows]

    async def unfinished(self) -> list[str]:
        """Every batch of this deployment that one of its session managers must still run to its end."""
        rows = await self._pool.fetch(
            "SELECT id FROM batches WHERE namespace = $2 AND status = ANY($1::text[])",
            list(UNFINISHED),
            self._namespace,
        )
        return [r["id"] for r in rows]

    async def forget_lines(self, batch_id: str) -> int:
        """Delete the lines of `batch_id` if it has ended (its files hold their answers); how many."""
        status = await self._pool.execute(
            "DELETE FROM batch_lines WHERE batch_id = $1"
            " AND EXISTS (SELECT 1 FROM batches WHERE id = $1 AND status = ANY($2::text[]) AND namespace = $3)",
            batch_id,
            list(TERMINAL),
            self._namespace,
        )
        return _count(status)

    async def sweep(self, *, retention_days: int) -> int:
        """Delete the lines of up to `_SWEEP_BATCHES` ended batches of this deployment that still have some (their owner
        died before it deleted them), and up to as many ended batches created more than
        `retention_days` ago (with their lines); how many batches it touched (0: nothing left)."""
        ended = list(TERMINAL)
        async with self._pool.acquire() as conn:
            with_lines = await conn.fetch(_ENDED_WITH_LINES, ended, _SWEEP_BATCHES, self._namespace)
            if with_lines:
                await conn.execute(
                    "DELETE FROM batch_lines WHERE batch_id = ANY($1::text[])", [r["id"] for r in with_lines]
                )
            old = _count(await conn.execute(_DELETE_OLD, ended, retention_days, _SWEEP_BATCHES, self._namespace))
        return len(with_lines) + old


_ENDED_WITH_LINES = """
SELECT b.id FROM batches b
WHERE b.namespace = $3 AND b.status = ANY($1::text[]) AND EXISTS (SELECT 1 FROM batch_lines l WHERE l.batch_id = b.id)
LIMIT $2
"""
_DELETE_OLD = """
DELETE FROM batches WHERE id IN (
    SELECT id FROM batches
    WHERE namespace = $4 AND status = ANY($1::text[]) AND created_at < now() - make_interval(days => $2)
    LIMIT $3
)
"""


def _jsonb(value: Any) -> str:
    """`value` as JSON PostgreSQL's jsonb takes: U+0000 (an answer or an error may echo it, as a
    validation error names a line's unknown field) becomes U+FFFD, as in every text the platform
    stores (`shared/postgres_text.py`); refused, a line's answer or a batch's errors would be
    retried for ever."""
    text = orjson.dumps(value).decode()
    return text if "\\u0000" not in text else orjson.dumps(_storable(value)).decode()


def _storable(value: Any) -> Any:
    if isinstance(value, str):
        return postgres_text(value)
    if isinstance(value, dict):
        return {postgres_text(str(k)): _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value


def _count(status: str) -> int:
    """The rows a command's status (`DELETE 12`) names."""
    return int(status.rsplit(" ", 1)[-1])


async def _copy(conn: Any, rows: list[tuple[str, int, str, str, str, int]]) -> int:
    """COPY `rows` into `batch_lines`; how many."""
    if not rows:
        return 0
    await conn.copy_records_to_table(
        "batch_lines", records=rows, columns=["batch_id", "line", "custom_id", "model", "body", "tokens"]
    )
    return len(rows)
