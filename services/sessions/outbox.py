"""The write-behind outbox: rows wait in a Redis Stream until a persister commits them to
PostgreSQL. An entry is acknowledged only after its commit, so a persister killed
mid-batch loses nothing: a live persister reclaims what it left pending.

Entries are idempotent (each row's UUID is its primary key; inserts skip conflicts),
so a batch written twice is harmless.
"""

import datetime as dt
from itertools import chain
from typing import Literal, overload

import orjson
import redis.asyncio as redis
from pydantic import BaseModel, field_validator

from shared.names import Names
from shared.redis_pipe import Arg

RowKind = Literal["message", "usage"]


@overload
def postgres_text(value: str) -> str: ...
@overload
def postgres_text(value: None) -> None: ...
def postgres_text(value: str | None) -> str | None:
    """`value` as PostgreSQL can store it: its text type cannot hold U+0000, which becomes U+FFFD.

    One row PostgreSQL refuses would stop its whole batch, and so every later row, from persisting.
    """
    if value is None or "\x00" not in value:
        return value
    return value.replace("\x00", "\ufffd")


class MessageRow(BaseModel):
    """A message as PostgreSQL stores it (the Redis history keeps the text exactly as it was)."""

    id: str
    conversation_id: str
    seq: int
    role: str
    content: str
    status: str
    job_id: str | None = None
    created_at: dt.datetime

    @field_validator("role", "content", "status")
    @classmethod
    def _storable(cls, value: str) -> str:
        return postgres_text(value)

    def copy_line(self) -> bytes:
        """The row in PostgreSQL's COPY text format, rendered once here so the persister only
        concatenates lines (its hot path)."""
        fields = (
            self.id,
            self.conversation_id,
            str(self.seq),
            self.role,
            self.content,
            self.status,
            self.job_id,
            self.created_at.isoformat(),
        )
        return ("\t".join(_copy_escape(f) for f in fields) + "\n").encode()


def _copy_escape(value: str | None) -> str:
    if value is None:
        return "\\N"
    return value.translate(_COPY_ESCAPES)


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


class UsageRow(BaseModel):
    job_id: str
    tenant: str
    key_id: str | None
    model: str
    prompt_tokens: int
    completion_tokens: int
    latency_ms: int
    created_at: dt.datetime

    @field_validator("tenant", "key_id", "model")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        return postgres_text(value)


class Outbox:
    """Appends rows to the outbox stream: every entry is written here."""

    def __init__(self, client: redis.Redis, names: Names) -> None:
        self._redis = client
        self._names = names

    async def append(self, kind: RowKind, row: BaseModel, *, pipe: redis.client.Pipeline | None = None) -> None:
        """Queue `row` for PostgreSQL; with `pipe`, as part of the caller's pipeline."""
        target = pipe if pipe is not None else self._redis
        # redis-py types `fields` as an invariant Dict of every encodable type; a Mapping would accept ours.
        result = target.xadd(self._names.outbox, _entry_fields(kind, row))  # type: ignore[arg-type]
        if pipe is None:
            await result

    def append_command(self, kind: RowKind, row: BaseModel) -> tuple[Arg, ...]:
        """The command queueing `row` for PostgreSQL, for a `RedisPipe` to send with the other
        writes of its round trip."""
        return ("XADD", self._names.outbox, "*", *chain(*_entry_fields(kind, row).items()))


def _entry_fields(kind: RowKind, row: BaseModel) -> dict[str, bytes | str]:
    """An outbox entry's fields. A message travels only as its COPY line (the persister
    concatenates them); a usage row as JSON."""
    if isinstance(row, MessageRow):
        return {"kind": kind, "copy": row.copy_line()}
    return {"kind": kind, "row": orjson.dumps(row.model_dump(mode="json"))}
