"""Bodies of OpenAI's Conversations API (`/v1/conversations`), on Axon's sessions.

Plain pydantic (no fastapi), like `shared/session_requests.py`: the session manager validates
bodies with them and the gateway's OpenAPI document is generated from them. Items are checked
and mapped onto session messages by `services/sessions/conversations/protocol.py` (a bad item gets a 400
naming it, `items[0].type`), so here they are JSON objects that the document describes as that
module reads them (`ITEM_SCHEMA`).
"""

from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic.config import JsonDict

# At most 20 items at a time, as OpenAI takes them.
MAX_ITEMS = 20
# OpenAI's limits on metadata: 16 pairs, keys of 1 to 64 characters, values of at most 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# PostgreSQL's text and jsonb cannot hold U+0000 (refused where it would be stored as is).
NO_NUL: Final[JsonDict] = {"not": {"type": "string", "pattern": "\\u0000"}}

_STRING: Final = {"type": "string"}
_CALL_ID: Final = {"type": "string", "minLength": 1}
_TEXT: Final = {
    "anyOf": [
        _STRING,
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": _STRING},
                "required": ["type", "text"],
            },
        },
    ]
}
ITEM_SCHEMA: Final = {
    "description": "A `message` (its `type` may be left out), a `function_call` or a `function_call_output`.",
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "assistant", "system", "developer"]},
                "content": _TEXT,
            },
            "required": ["role", "content"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "function_call"},
                "call_id": _CALL_ID,
                "name": _STRING,
                "arguments": _STRING,
            },
            "required": ["type", "call_id", "name", "arguments"],
        },
        {
            "type": "object",
            "properties": {"type": {"const": "function_call_output"}, "call_id": _CALL_ID, "output": _TEXT},
            "required": ["type", "call_id", "output"],
        },
    ],
}
Item = Annotated[dict[str, Any], WithJsonSchema(ITEM_SCHEMA)]
Items = Annotated[list[Item], Field(max_length=MAX_ITEMS)]
_METADATA_SCHEMA: Final = {
    "type": "object",
    "maxProperties": MAX_METADATA_PAIRS,
    "propertyNames": {"minLength": 1, "maxLength": MAX_METADATA_KEY, **NO_NUL},
    "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE, **NO_NUL},
}
Metadata = Annotated[dict[str, str], WithJsonSchema(_METADATA_SCHEMA)]


def _metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """`metadata` within OpenAI's limits (checked here so that a 400 names `metadata`, not a key)."""
    if not metadata:
        return metadata
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs")
    for key, value in metadata.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY:
            raise ValueError(f"keys are strings of 1 to {MAX_METADATA_KEY} characters")
        if len(value) > MAX_METADATA_VALUE:
            raise ValueError(f"values are strings of at most {MAX_METADATA_VALUE} characters")
        # jsonb cannot hold U+0000: refuse it here rather than fail the INSERT (a 500).
        if "\x00" in key or "\x00" in value:
            raise ValueError("must not contain NUL (U+0000) characters")
    return metadata


class ConversationCreate(BaseModel):
    """`POST /v1/conversations`: optional initial items and metadata."""

    model_config = ConfigDict(extra="forbid")

    items: Items | None = None
    metadata: Metadata | None = None

    @field_validator("metadata")
    @classmethod
    def _within_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _metadata(value)


class ConversationUpdate(BaseModel):
    """`POST /v1/conversations/{id}`: the new metadata (null clears it)."""

    model_config = ConfigDict(extra="forbid")

    metadata: Metadata | None

    @field_validator("metadata")
    @classmethod
    def _within_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _metadata(value)


class ConversationItemsCreate(BaseModel):
    """`POST /v1/conversations/{id}/items`: the items to append (1 to 20). `include` is accepted
    and has no effect: no item Axon stores has any of its optional fields."""

    model_config = ConfigDict(extra="forbid")

    items: Annotated[Items, Field(min_length=1)]
    include: list[str] | None = None
