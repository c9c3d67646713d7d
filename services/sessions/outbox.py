"""The write-behind outbox: rows wait in a Redis Stream until a persister commits them to
PostgreSQL. An entry is acknowledged only after its commit, so a persister killed
mid-batch loses nothing: a live persister reclaims what it left pending.

Entries are idempotent (each row's UUID is its primary key; inserts skip conflicts),
so a batch written twice is harmless.
"""

import datetime as dt
from itertools import chain
from typing import TYPE_CHECKING, Any, Literal

import orjson
import redis.asyncio as redis
from pydantic import BaseModel, field_validator

from shared.names import Names
from shared.postgres_text import postgres_text
from shared.redis_pipe import Arg
from shared.schemas import ToolCall

if TYPE_CHECKING:
    from services.sessions.history import StoredMessage

RowKind = Literal["message", "usage", "response"]


def _storable_json(value: Any) -> Any:
    """`value` (decoded JSON) with every string made storable: jsonb cannot hold U+0000 either."""
    if isinstance(value, str):
        return postgres_text(value)
    if isinstance(value, list):
        return [_storable_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _storable_json(v) for k, v in value.items()}
    return value


def tool_calls_json(calls: list[ToolCall] | None) -> str | None:
    """An answer's tool calls as the JSON text of the `messages.tool_calls` column (OpenAI's shape)."""
    if not calls:
        return None
    data = [call.model_dump() for call in calls]
    text = orjson.dumps(data).decode()
    if "\\u0000" in text:
        text = orjson.dumps(_storable_json(data)).decode()
    return text


# The columns of a message's COPY line, in order. `format` 2 entries have them all; entries
# written before tool calls were stored (format 1: no `format` field) stop at `created_at`, and
# the persister fills the rest with NULL.
MESSAGE_COLUMNS = (
    "id",
    "conversation_id",
    "seq",
    "role",
    "content",
    "status",
    "job_id",
    "created_at",
    "tool_calls",
    "tool_call_id",
    "name",
)
MESSAGE_FORMAT = "2"


class MessageRow(BaseModel):
    """A message as PostgreSQL stores it (the Redis history keeps the text exactly as it was).

    `tool_calls` is the JSON text of an assistant answer's calls; `tool_call_id` and `name` are
    a tool result's.
    """

    id: str
    conversation_id: str
    seq: int
    role: str
    content: str
    status: str
    job_id: str | None = None
    created_at: dt.datetime
    tool_calls: str | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("role", "content", "status", "tool_call_id", "name")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        return postgres_text(value)

    @classmethod
    def of(cls, message: "StoredMessage", *, conversation_id: str) -> "MessageRow":
        return cls(
            conversation_id=conversation_id,
            tool_calls=tool_calls_json(message.tool_calls),
            **message.model_dump(exclude={"tool_calls"}),
        )

    def copy_line(self) -> bytes:
        """The row in PostgreSQL's COPY text format (`MESSAGE_COLUMNS`), rendered once here so the
        persister only concatenates lines (its hot path)."""
        fields = (
            self.id,
            self.conversation_id,
            str(self.seq),
            self.role,
            self.content,
            self.status,
            self.job_id,
            self.created_at.isoformat(),
            self.tool_calls,
            self.tool_call_id,
            self.name,
        )
        return ("\t".join(_copy_escape(f) for f in fields) + "\n").encode()


def _copy_escape(value: str | None) -> str:
    if value is None:
        return "\\N"
    return value.translate(_COPY_ESCAPES)


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


class ResponseRow(BaseModel):
    """A stored response (`services/sessions/responses/store.py`): `body` is its Redis value's JSON."""

    id: str
    tenant: str
    body: dict[str, Any]
    created_at: dt.datetime
    expires_at: dt.datetime

    @field_validator("body")
    @classmethod
    def _storable_body(cls, value: dict[str, Any]) -> dict[str, Any]:
        storable: dict[str, Any] = _storable_json(value)
        return storable

    @field_validator("tenant")
    @classmethod
    def _storable(cls, value: str) -> str:
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
    concatenates them) and the line's `format`; a usage row as JSON."""
    if isinstance(row, MessageRow):
        return {"kind": kind, "copy": row.copy_line(), "format": MESSAGE_FORMAT}
    return {"kind": kind, "row": orjson.dumps(row.model_dump(mode="json"))}
