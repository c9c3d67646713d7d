"""The body of OpenAI's `POST /v1/batches`.

Plain pydantic (no fastapi), like `shared/conversation_requests.py`: the session manager validates
bodies with it and the gateway's OpenAPI document is generated from it.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.conversation_requests import Metadata, _metadata

# The endpoints a batch's lines may call, as OpenAI's Batch API takes them.
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]


class BatchCreate(BaseModel):
    """`POST /v1/batches`: run every request of an uploaded JSONL file (`purpose=batch`)."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: BatchEndpoint
    # OpenAI's only window.
    completion_window: Literal["24h"]
    # OpenAI's limits, documented as the schema (`Metadata`) and checked by `_metadata`.
    metadata: Metadata | None = None

    @field_validator("metadata")
    @classmethod
    def _within_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _metadata(value)
