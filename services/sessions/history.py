"""Sessions and their history: Redis first, PostgreSQL behind it.

Session rows are written to PostgreSQL at once (they are rare); messages go to Redis
and, through the outbox, to PostgreSQL in batches. Reads take the recent history from
Redis and fall back to PostgreSQL (then re-cache). Sessions belong to a tenant: another
tenant gets 404, exactly as for a session that does not exist; and to a deployment
(`AXON_NAMESPACE`, the `namespace` of their row): deployments sharing the database never read or
list each other's sessions.
"""

import datetime as dt
import uuid
from typing import cast

import asyncpg
import orjson
import redis.asyncio as redis
from pydantic import BaseModel, Field, TypeAdapter

from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import MessageRow, Outbox
from shared.errors import NotFound
from shared.names import Names
from shared.schemas import Message, ToolCall

_TOMBSTONE = b"-"
# Compare-and-delete: only the holder releases a session's lock.
_UNLOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# Take a lock whose holder's process is gone (its liveness key expired), atomically.
_STEAL = """
local holder = redis.call('GET', KEYS[1])
if not holder then return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 1 or 0 end
local instance = string.match(holder, '^([^|]+)|')
if instance and redis.call('EXISTS', ARGV[3] .. instance) == 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# Compare-and-set one entry of a history list (found by its exact text): marks an item deleted
# without re-encoding the JSON in Lua; 0 when the entry is gone or changed meanwhile.
_REPLACE = """
local entries = redis.call('LRANGE', KEYS[1], 0, -1)
for i, entry in ipairs(entries) do
  if entry == ARGV[1] then
    redis.call('LSET', KEYS[1], i - 1, ARGV[2])
    return 1
  end
end
return 0
"""
# KEYS: a session's seq counter. ARGV: its expiry (s), the seq to continue after if the counter is
# missing ('' : none known yet). Returns the next seq, or nil when the counter is missing and no
# seq was given: the caller then reads where to continue and calls again with it.
_NEXT_SEQ = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ARGV[2] == '' then return false end
  redis.call('SET', KEYS[1], ARGV[2])
end
local seq = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return seq
"""
_COLUMNS = "id, tenant, title, system_prompt, model, created_at, updated_at, metadata"
# A message's columns, and the parts of it deleted as conversation items (`deleted_items`).
_MESSAGE_SELECT = (
    "SELECT m.id, m.seq, m.role, m.content, m.status, m.job_id, m.created_at, m.tool_calls, m.tool_call_id,"
    " m.name, (SELECT array_agg(d.part ORDER BY d.part) FROM deleted_items d"
    " WHERE d.conversation_id = m.conversation_id AND d.seq = m.seq) AS deleted"
)


class SessionInfo(BaseModel):
    id: str
    tenant: str
    title: str | None = None
    system_prompt: str | None = None
    model: str | None = None
    created_at: dt.datetime
    updated_at: dt.datetime
    # The Conversations API's metadata (at most 16 string pairs); sessions created before it have none.
    metadata: dict[str, str] = Field(default_factory=dict)

    def public(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "session",
            "title": self.title,
            "system_prompt": self.system_prompt,
            "model": self.model,
            "created_at": int(self.created_at.timestamp()),
            "updated_at": int(self.updated_at.timestamp()),
        }


class StoredMessage(BaseModel):
    """A message of a session's history. An assistant answer that called tools keeps its
    `tool_calls`; a tool's result keeps the `tool_call_id` it answers and the tool's `name`.

    Through the Conversations API a message is one or more items: part 0 its text, part i + 1
    its tool call i. `deleted` lists the parts deleted as items; `visible()` is the message
    without them, as prompts and the sessions API see it.
    """

    id: str
    seq: int
    role: str
    content: str
    status: str = "complete"
    job_id: str | None = None
    created_at: dt.datetime
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    deleted: list[int] | None = None

    def visible(self) -> "StoredMessage | None":
        """The message without its deleted items (None when nothing of it is left)."""
        if not self.deleted:
            return self
        gone = set(self.deleted)
        calls = [call for i, call in enumerate(self.tool_calls or ()) if i + 1 not in gone]
        if not calls and (0 in gone or (self.tool_calls and not self.content)):
            return None  # an answer that was only tool calls has no text item
        content = "" if 0 in gone else self.content
        return self.model_copy(update={"content": content, "tool_calls": calls or None, "deleted": None})

    def public(self) -> dict[str, object]:
        """The message as the API lists it: OpenAI's message object (`tool_calls`, `tool_call_id`
        and `name` when it has them; the content of an answer that is only tool calls is null)."""
        body: dict[str, object] = {
            "id": self.id,
            "object": "session.message",
            "seq": self.seq,
            "role": self.role,
            "content": None if self.tool_calls and not self.content else self.content,
            "status": self.status,
            "created_at": int(self.created_at.timestamp()),
        }
        if self.tool_calls:
            body["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            body["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            body["name"] = self.name
        return body


def _session_id(raw: str) -> str:
    """Normalise a session id (or its conversation id, `conv_<hex>`: the Conversations API's);
    anything that is not a UUID cannot exist (404, not 400)."""
    try:
        return str(uuid.UUID(raw.removeprefix("conv_")))
    except ValueError:
        raise NotFound("No such session.", param="session_id", code="session_not_found") from None


def _info(row: asyncpg.Record) -> SessionInfo:
    return SessionInfo(
        id=str(row["id"]),
        tenant=row["tenant"],
        title=row["title"],
        system_prompt=row["system_prompt"],
        model=row["model"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        # jsonb arrives as its JSON text (no codec is set on the pool).
        metadata=orjson.loads(row["metadata"]),
    )


class SessionStore:
    def __init__(
        self,
        *,
        client: redis.Redis,
        db: asyncpg.Pool,
        names: Names,
        outbox: Outbox,
        metrics: SessionsMetrics,
        history_max_messages: int,
        cache_ttl_s: int,
    ) -> None:
        self._redis = client
        self._db = db
        self._names = names
        self._outbox = outbox
        self._metrics = metrics
        self._history_max = history_max_messages
        self._ttl_s = cache_ttl_s
        self._unlock = client.register_script(_UNLOCK)
        self._steal = client.register_script(_STEAL)
        self._replace = client.register_script(_REPLACE)
        self._next_seq_script = client.register_script(_NEXT_SEQ)

    # Sessions
    async def create(
        self,
        tenant: str,
        *,
        title: str | None,
        system_prompt: str | None,
        model: str | None,
        metadata: dict[str, str] | None = None,
    ) -> SessionInfo:
        row = await self._db.fetchrow(
            "INSERT INTO conversations (id, tenant, title, system_prompt, model, metadata, namespace)"
            f" VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7) RETURNING {_COLUMNS}",
            uuid.uuid4(),
            tenant,
            title,
            system_prompt,
            model,
            orjson.dumps(metadata or {}).decode(),
            self._names.namespace,
        )
        assert row is not None  # INSERT ... RETURNING always returns the row it inserted
        info = _info(row)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._names.session(info.id), info.model_dump_json(), ex=self._ttl_s)
            pipe.set(self._names.session_seq(info.id), 0, ex=self._ttl_s)
            await pipe.execute()
        return info

    async def get(self, tenant: str, session_id: str) -> SessionInfo:
        """The tenant's session.

        Raises:
            NotFound: no such session, or it belongs to another tenant.
        """
        session_id = _session_id(session_id)
        raw = await self._redis.get(self._names.session(session_id))
        if raw == _TOMBSTONE:
            info = None
        elif raw is not None:
            info = SessionInfo.model_validate_json(raw)
        else:
            row = await self._db.fetchrow(
                f"SELECT {_COLUMNS} FROM conversations WHERE id = $1 AND namespace = $2",
                uuid.UUID(session_id),
                self._names.namespace,
            )
            info = _info(row) if row else None
            if info is not None:
                await self._redis.set(self._names.session(session_id), info.model_dump_json(), ex=self._ttl_s)
        if info is None or info.tenant != tenant:
            raise NotFound("No such session.", param="session_id", code="session_not_found")
        return info

    async def list_sessions(self, tenant: str, *, limit: int, after: str | None) -> tuple[list[SessionInfo], bool]:
        """The tenant's sessions of this deployment, newest first, `limit` at a time after the session
        `after`."""
        cursor = await self.get(tenant, after) if after else None
        rows = await self._db.fetch(
            f"SELECT {_COLUMNS} FROM conversations WHERE namespace = $5 AND tenant = $1"
            " AND ($2::timestamptz IS NULL OR (created_at, id) < ($2, $3))"
            " ORDER BY created_at DESC, id DESC LIMIT $4",
            tenant,
            cursor.created_at if cursor else None,
            uuid.UUID(cursor.id) if cursor else None,
            limit + 1,
            self._names.namespace,
        )
        return [_info(r) for r in rows[:limit]], len(rows) > limit

    async def rename(self, tenant: str, session_id: str, *, title: str | None) -> SessionInfo:
        return await self._update(tenant, session_id, "title = $2", title)

    async def set_metadata(self, tenant: str, session_id: str, metadata: dict[str, str]) -> SessionInfo:
        """Replace the session's metadata (the Conversations API's update)."""
        return await self._update(tenant, session_id, "metadata = $2::jsonb", orjson.dumps(metadata).decode())

    async def _update(self, tenant: str, session_id: str, assignment: str, value: str | None) -> SessionInfo:
        info = await self.get(tenant, session_id)
        row = await self._db.fetchrow(
            f"UPDATE conversations SET {assignment}, updated_at = now() WHERE id = $1 RETURNING {_COLUMNS}",
            uuid.UUID(info.id),
            value,
        )
        if row is None:  # deleted since `get` found it
            raise NotFound("No such session.", param="session_id", code="session_not_found")
        updated = _info(row)
        await self._redis.set(self._names.session(info.id), updated.model_dump_json(), ex=self._ttl_s)
        return updated

    async def delete(self, tenant: str, session_id: str) -> None:
        """Remove the session and its messages from PostgreSQL and Redis."""
        info = await self.get(tenant, session_id)
        await self._db.execute("DELETE FROM conversations WHERE id = $1", uuid.UUID(info.id))
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._names.session(info.id), _TOMBSTONE, ex=self._ttl_s)
            pipe.delete(self._names.history(info.id), self._names.session_seq(info.id), self._names.affinity(info.id))
            await pipe.execute()

    # Turn-taking
    async def lock(self, session_id: str, *, holder: str, ttl_s: float) -> bool:
        """Take the session's turn lock; `holder` is `<instance id>|<job id>`.

        A lock left by a session manager that died is taken over at once instead of
        blocking the session until it expires.
        """
        key = self._names.session_lock(session_id)
        if await self._redis.set(key, holder, nx=True, px=int(ttl_s * 1000)):
            return True
        prefix = self._names.sessions_instance("")
        return bool(await self._steal(keys=[key], args=[holder, int(ttl_s * 1000), prefix]))

    async def unlock(self, session_id: str, *, holder: str) -> None:
        await self._unlock(keys=[self._names.session_lock(session_id)], args=[holder])

    # Messages
    async def history(self, info: SessionInfo) -> list[StoredMessage]:
        """The session's recent messages, oldest first (at most the cached length), without the
        items deleted from them."""
        # Bytes: our clients never set decode_responses (redis-py types replies as bytes | str).
        raw = cast(list[bytes], await self._redis.lrange(self._names.history(info.id), 0, -1))
        return await self._history(info, raw)

    async def history_and_home(self, info: SessionInfo) -> tuple[list[StoredMessage], str | None]:
        """The session's recent messages, and the worker that served its last turn (its affinity
        record, `services/worker/chunk_publisher.py`), read in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.lrange(self._names.history(info.id), 0, -1)
            pipe.get(self._names.affinity(info.id))
            raw, home = await pipe.execute()
        return await self._history(info, raw), home.decode() if home else None

    async def _history(self, info: SessionInfo, raw: list[bytes]) -> list[StoredMessage]:
        """The visible messages of the cached list `raw` (see `_stored`)."""
        return _visible(await self._stored(info, raw))

    async def _stored(self, info: SessionInfo, raw: list[bytes]) -> list[StoredMessage]:
        """The messages of the cached list `raw` as stored, deleted items marked; if it is empty,
        from PostgreSQL (then re-cached)."""
        if raw:
            self._metrics.history_cache.labels("hit").inc()
            return [StoredMessage.model_validate_json(item) for item in raw]
        self._metrics.history_cache.labels("miss").inc()
        rows = await self._db.fetch(
            f"SELECT * FROM ({_MESSAGE_SELECT} FROM messages m WHERE m.conversation_id = $1"
            " ORDER BY m.seq DESC LIMIT $2) recent ORDER BY seq",
            uuid.UUID(info.id),
            self._history_max,
        )
        messages = [_message(r) for r in rows]
        if messages:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.delete(self._names.history(info.id))
                pipe.rpush(self._names.history(info.id), *[m.model_dump_json(exclude_none=True) for m in messages])
                pipe.expire(self._names.history(info.id), self._ttl_s)
                await pipe.execute()
        return messages

    async def page(self, info: SessionInfo, *, after_seq: int, limit: int) -> tuple[list[StoredMessage], bool]:
        """Messages with `seq` > `after_seq`, oldest first; recent ones not yet persisted come from Redis.
        A message whose items were all deleted is left out (the page then holds fewer)."""
        ordered = await self.messages(info, start_seq=after_seq + 1, descending=False, limit=limit + 1)
        return _visible(ordered[:limit]), len(ordered) > limit

    async def messages(self, info: SessionInfo, *, start_seq: int, descending: bool, limit: int) -> list[StoredMessage]:
        """At most `limit` messages as stored (deleted items marked), from `seq` = `start_seq` up,
        or (`descending`) down; PostgreSQL's rows merged with the recent ones in Redis, which may
        not be persisted yet."""
        rows = await self._db.fetch(
            f"{_MESSAGE_SELECT} FROM messages m WHERE m.conversation_id = $1"
            + (" AND m.seq <= $2 ORDER BY m.seq DESC" if descending else " AND m.seq >= $2 ORDER BY m.seq")
            + " LIMIT $3",
            uuid.UUID(info.id),
            start_seq,
            limit,
        )
        by_seq = {r["seq"]: _message(r) for r in rows}
        raw = cast(list[bytes], await self._redis.lrange(self._names.history(info.id), 0, -1))
        for message in await self._stored(info, raw):
            if not ((message.seq <= start_seq) if descending else (message.seq >= start_seq)):
                continue
            persisted = by_seq.setdefault(message.seq, message)
            if persisted is not message and message.deleted:  # marked in Redis too: the union
                deleted = sorted({*(persisted.deleted or ()), *message.deleted})
                by_seq[message.seq] = persisted.model_copy(update={"deleted": deleted})
        return [by_seq[s] for s in sorted(by_seq, reverse=descending)][:limit]

    async def delete_item(self, info: SessionInfo, *, seq: int, part: int) -> None:
        """Delete part `part` of message `seq` (an item of the Conversations API): a row of
        `deleted_items` at once (so it holds for a message still in the outbox too), then the
        mark on the message's entry in the Redis history, which prompts are built from."""
        await self._db.execute(
            "INSERT INTO deleted_items (conversation_id, seq, part)"
            " SELECT $1, $2, $3 WHERE EXISTS (SELECT 1 FROM conversations WHERE id = $1) ON CONFLICT DO NOTHING",
            uuid.UUID(info.id),
            seq,
            part,
        )
        key = self._names.history(info.id)
        while True:
            entries = cast(list[bytes], await self._redis.lrange(key, 0, -1))
            found = [(raw, m) for raw in entries if (m := StoredMessage.model_validate_json(raw)).seq == seq]
            if not found:
                return  # not in the cached history: its rebuild reads `deleted_items`
            entry, message = found[0]
            if part in (message.deleted or ()):
                return
            marked = message.model_copy(update={"deleted": sorted({*(message.deleted or ()), part})})
            if await self._replace(keys=[key], args=[entry, marked.model_dump_json(exclude_none=True)]):
                return

    async def _next_seq(self, session_id: str) -> int:
        """The session's next message `seq`, from its counter, whose expiry (`cache_ttl_s`, as its
        history's) every message renews. A counter that expired (a session idle that long) or was
        lost (cache flushed) continues after the last seq PostgreSQL or the Redis history holds
        (messages still in the outbox are in the history: it is written in the same transaction)."""
        key = self._names.session_seq(session_id)
        seq = await self._next_seq_script(keys=[key], args=[self._ttl_s, ""])
        if seq is None:
            stored = await self._db.fetchval(
                "SELECT coalesce(max(seq), 0) FROM messages WHERE conversation_id = $1", uuid.UUID(session_id)
            )
            newest = cast(bytes | None, await self._redis.lindex(self._names.history(session_id), -1))
            cached = StoredMessage.model_validate_json(newest).seq if newest else 0
            seq = await self._next_seq_script(keys=[key], args=[self._ttl_s, max(stored, cached)])
        return int(seq)

    async def append(self, info: SessionInfo, message: Message, *, status: str, job_id: str | None) -> StoredMessage:
        """Store a message (with its tool calls, or the call it answers): in the Redis history and,
        in the same round trip, in the outbox."""
        stored = StoredMessage(
            id=str(uuid.uuid4()),
            seq=await self._next_seq(info.id),
            role=message.role,
            content=message.content,
            status=status,
            job_id=job_id,
            created_at=dt.datetime.now(dt.UTC),
            tool_calls=message.tool_calls or None,
            tool_call_id=message.tool_call_id,
            name=message.name,
        )
        row = MessageRow.of(stored, conversation_id=info.id)
        key = self._names.history(info.id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.rpush(key, stored.model_dump_json(exclude_none=True))
            pipe.ltrim(key, -self._history_max, -1)
            pipe.expire(key, self._ttl_s)
            await self._outbox.append("message", row, pipe=pipe)
            await pipe.execute()
        return stored


def _message(row: asyncpg.Record) -> StoredMessage:
    return StoredMessage(
        id=str(row["id"]),
        seq=row["seq"],
        role=row["role"],
        content=row["content"],
        status=row["status"],
        job_id=str(row["job_id"]) if row["job_id"] else None,
        created_at=row["created_at"],
        # jsonb arrives as its JSON text (no codec is set on the pool).
        tool_calls=_tool_calls.validate_json(row["tool_calls"]) if row["tool_calls"] else None,
        tool_call_id=row["tool_call_id"],
        name=row["name"],
        deleted=list(row["deleted"]) if row["deleted"] else None,
    )


def _visible(messages: list[StoredMessage]) -> list[StoredMessage]:
    return [shown for m in messages if (shown := m.visible()) is not None]


_tool_calls: TypeAdapter[list[ToolCall]] = TypeAdapter(list[ToolCall])
