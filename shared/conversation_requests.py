"""Bodies of OpenAI's Conversations API (`/v1/conversations`), on Axon's sessions.

Plain pydantic (no fastapi), like `shared/session_requests.py`: the session manager validates
bodies with them and the gateway's OpenAPI document is generated from them. Items are checked
and mapped onto session messages by `services/sessions/conversations/protocol.py` (a bad item gets a 400
naming it, `items[0].type`), so here they are only JSON objects.
"""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# At most 20 items at a time, as OpenAI takes them.
MAX_ITEMS = 20
Items = Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS)]
# OpenAI's limits on metadata: 16 pairs, keys of 1 to 64 characters, values of at most 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


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
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _within_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _metadata(value)


class ConversationUpdate(BaseModel):
    """`POST /v1/conversations/{id}`: the new metadata (null clears it)."""

    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, str] | None

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
