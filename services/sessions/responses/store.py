"""Stored responses: one Redis key each (`<ns>:response:<id>`), written behind to PostgreSQL's
`responses` through the outbox once finished; an unfinished one is leased to the session manager
relaying it (`leases.py`) and finished once, by whoever finishes it first."""

import datetime as dt
from typing import Any

import asyncpg
from pydantic import BaseModel
from redis.asyncio import Redis

from services.sessions.outbox import Outbox, ResponseRow
from services.sessions.responses.protocol import RESPONSE_PREFIX
from shared.internal_headers import Caller
from shared.names import Names
from shared.postgres_text import postgres_text
from shared.redis_pipe import PipeScript, RedisPipe
from shared.schemas import Message


class Pending(BaseModel):
    """What finishing an unfinished stored response needs, kept in its record until it is finished."""

    # The first `history` messages of its context are its history, the rest its input.
    history: int
    # The conversation's session it is appended to once answered.
    session_id: str | None = None
    # Its job's deadline (epoch seconds): past it, nothing more is generated.
    deadline: float
    # What its request's admission charged (key, estimate, budget reservation, concurrency
    # lease): settled by whoever stores it when its relay handed it over (`take_over`).
    caller: Caller | None = None
    # The span of the request that created it (tracing on): a take-over's span is its child, so
    # the response's whole life is one trace.
    traceparent: str | None = None


class StoredResponse(BaseModel):
    """What `<ns>:response:<id>` holds."""

    tenant: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    # The chain's messages up to and with this response's output: the next one's history.
    context: list[Message]
    # Its job (whose chunk log replays its events); None for responses stored before logs.
    job_id: str | None = None
    # The seq of the last chunk of its answer, once finished (-1: none).
    last_seq: int | None = None
    # Set while it is unfinished.
    pending: Pending | None = None


class ResponseStore:
    """Stored responses: in Redis for `ttl_s`, written behind to PostgreSQL's `responses` through
    the outbox once finished, by tenant. A read that misses Redis (evicted, or Redis lost it)
    reads PostgreSQL. An unfinished one is leased (`leases.py`)."""

    def __init__(
        self, redis: Redis, db: asyncpg.Pool, outbox: Outbox, *, namespace: str, ttl_s: int, pipe: RedisPipe
    ) -> None:
        self._redis = redis
        # Each response's two writes (`open`, `finish`) go through the hot path's pipe.
        self._pipe = pipe
        self._db = db
        self._outbox = outbox
        self._names = Names(namespace)
        self._ttl_s = ttl_s
        self._running = self._names.responses_running
        self._owners = self._names.responses_owners
        self._cancel_channel = self._names.cancel_channel

    def key(self, response_id: str) -> str:
        return self._names.response(response_id)

    def _row(self, response_id: str, stored: StoredResponse) -> ResponseRow:
        created = dt.datetime.now(dt.UTC)
        return ResponseRow(
            id=response_id,
            tenant=stored.tenant,
            body=stored.model_dump(mode="json", exclude_none=True),
            created_at=created,
            expires_at=created + dt.timedelta(seconds=self._ttl_s),
        )

    async def open(self, response_id: str, stored: StoredResponse, *, owner: str, lease_expiry_ms: int) -> None:
        """Keep unfinished `stored` in Redis (not yet in PostgreSQL) and lease it to `owner`, in one
        script call."""
        await self._pipe.submit_script(
            _OPEN,
            [self.key(response_id), self._running, self._owners],
            [stored.model_dump_json(exclude_none=True), self._ttl_s, lease_expiry_ms, response_id, owner],
        )

    async def finish(self, response_id: str, stored: StoredResponse) -> bool:
        """Store finished `stored` and queue its row for PostgreSQL, if the response is still
        unfinished (running), in one script: False when another finisher was first."""
        _, outbox, _, *fields = self._outbox.append_command("response", self._row(response_id, stored))
        result = await self._pipe.submit_script(
            _FINISH,
            [self.key(response_id), self._running, self._owners, outbox],
            [response_id, stored.model_dump_json(exclude_none=True), self._ttl_s, *fields],
        )
        return bool(result)

    async def drop_lease(self, response_id: str) -> None:
        """The response is no longer running (its record is gone or finished)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self._running, response_id)
            pipe.hdel(self._owners, response_id)
            await pipe.execute()

    async def cancel_job(self, job_id: str) -> None:
        """Tell the workers to stop generating (or skip) `job_id`."""
        await self._redis.publish(self._cancel_channel, job_id)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's stored response, None if there is none (unknown, expired, deleted, or
        another tenant's)."""
        stored = await self.get_any(response_id)
        return stored if stored is not None and stored.tenant == tenant else None

    async def get_any(self, response_id: str) -> StoredResponse | None:
        """A stored response, whoever's it is."""
        if not response_id.startswith(RESPONSE_PREFIX) or len(response_id) > 64:
            return None
        raw = await self._redis.get(self.key(response_id))
        if raw is None:
            raw = await self._db.fetchval(_READ_RESPONSE, response_id)
            if raw is None:
                return None
        return StoredResponse.model_validate_json(raw)

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Delete the tenant's stored response: its row becomes a tombstone at once (so that its
        outbox entry, if not yet committed, cannot bring it back), then its Redis key goes. An
        unfinished one is no longer running and its job is cancelled."""
        stored = await self.get(tenant, response_id)
        if stored is None:
            return False
        expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self._ttl_s)
        await self._db.execute(_TOMBSTONE, response_id, postgres_text(tenant), expires)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key(response_id))
            pipe.zrem(self._running, response_id)
            pipe.hdel(self._owners, response_id)
            await pipe.execute()
        if stored.pending is not None and stored.job_id is not None:
            await self.cancel_job(stored.job_id)
        return True


_READ_RESPONSE = "SELECT body::text FROM responses WHERE id = $1 AND expires_at > now() AND body IS NOT NULL"
_TOMBSTONE = """
INSERT INTO responses (id, tenant, body, created_at, expires_at) VALUES ($1, $2, NULL, now(), $3)
ON CONFLICT (id) DO UPDATE SET body = NULL
"""
# KEYS: the response, running set, owners hash. ARGV: record, ttl (s), lease expiry (ms), id, owner.
# Stores an unfinished response and leases it to its relay.
_OPEN = PipeScript("""
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[3], ARGV[4], ARGV[5])
return 1
""")
# KEYS: the response, running set, owners hash, outbox. ARGV: id, record, ttl (s), outbox fields...
# The first finisher of a running response stores it; 0 for any later one.
_FINISH = PipeScript("""
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
redis.call('XADD', KEYS[4], '*', unpack(ARGV, 4))
return 1
""")
