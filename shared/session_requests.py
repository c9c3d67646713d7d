"""Bodies of Axon's sessions API (`POST /v1/sessions`, `PATCH /v1/sessions/{id}`).

Plain pydantic (no fastapi): the session manager validates bodies with them and the gateway's
OpenAPI document is generated from them.
"""

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.conversation_requests import NO_NUL

# How the document says what `_no_nul` checks.
_STORABLE = NO_NUL


def _no_nul(value: str | None) -> str | None:
    # PostgreSQL's text cannot hold U+0000: refuse it here rather than fail the INSERT (a 500).
    if value is not None and "\x00" in value:
        raise ValueError("must not contain NUL (U+0000) characters")
    return value


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str | None = Field(None, max_length=200, json_schema_extra=_STORABLE)
    system_prompt: str | None = Field(None, max_length=100_000, json_schema_extra=_STORABLE)
    model: str | None = Field(None, max_length=256, json_schema_extra=_STORABLE)

    @field_validator("title", "system_prompt", "model")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        return _no_nul(value)


class SessionUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str | None = Field(None, max_length=200, json_schema_extra=_STORABLE)

    @field_validator("title")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        return _no_nul(value)
