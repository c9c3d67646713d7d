"""The write-behind outbox: rows wait in a Redis Stream until a persister commits them to
PostgreSQL. An entry is acknowledged only after its commit, so a persister killed
mid-batch loses nothing: a live persister reclaims what it left pending.

Entries are idempotent (each row's UUID is its primary key; inserts skip conflicts),
so a batch written twice is harmless.
"""

import datetime as dt
from typing import Literal

import orjson
import redis.asyncio as redis
from pydantic import BaseModel

from shared.names import Names

RowKind = Literal["message", "usage"]


class MessageRow(BaseModel):
    id: str
    conversation_id: str
    seq: int
    role: str
    content: str
    status: str
    job_id: str | None = None
    created_at: dt.datetime


class UsageRow(BaseModel):
    job_id: str
    tenant: str
    key_id: str | None
    model: str
    prompt_tokens: int
    completion_tokens: int
    latency_ms: int
    created_at: dt.datetime


class Outbox:
    """Appends rows to the outbox stream."""

    def __init__(self, client: redis.Redis, names: Names) -> None:
        self._redis = client
        self._names = names

    async def append(self, kind: RowKind, row: BaseModel, *, pipe: redis.client.Pipeline | None = None) -> None:
        """Queue `row` for PostgreSQL; with `pipe`, as part of the caller's pipeline."""
        fields = {"kind": kind, "row": orjson.dumps(row.model_dump(mode="json"))}
        target = pipe if pipe is not None else self._redis
        result = target.xadd(self._names.outbox, fields)
        if pipe is None:
            await result


def decode_entry(fields: dict[bytes, bytes]) -> tuple[str, dict]:
    return fields[b"kind"].decode(), orjson.loads(fields[b"row"])
