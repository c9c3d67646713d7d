"""The body of Anthropic's `POST /v1/messages/batches`: its requests inline, each a `custom_id` and
the `params` of a Messages API request.

Plain pydantic (no fastapi), like `shared/batch_requests.py`: the session manager validates bodies
with it and the gateway's OpenAPI document is generated from it. As Anthropic's API does, the
batch's shape is checked when it is created (a 400 naming the request: `requests.3.custom_id`),
each request's `params` when it runs: a line whose params the Messages API refuses is `errored`
in the results, with that error.
"""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from shared.conversation_requests import NO_NUL

# Anthropic's limits: at most 100,000 requests a batch, custom ids of 1 to 64 of these characters.
MAX_REQUESTS = 100_000
CUSTOM_ID_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"

_PARAMS_SCHEMA = {
    "type": "object",
    "description": "A Messages API request (`POST /v1/messages`), without `stream`. Checked when the "
    "request runs: one the Messages API refuses is `errored` in the results, with that error.",
    # PostgreSQL's text cannot hold U+0000 (the line's model is stored apart).
    "properties": {"model": {"type": "string", "minLength": 1, **NO_NUL}},
    "required": ["model"],
}


class MessageBatchRequest(BaseModel):
    """One request of a batch."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(
        min_length=1,
        max_length=64,
        pattern=CUSTOM_ID_PATTERN,
        description="Your id of the request, unique in the batch: its result carries it.",
    )
    params: Annotated[dict[str, Any], WithJsonSchema(_PARAMS_SCHEMA)]


class MessageBatchCreate(BaseModel):
    """`POST /v1/messages/batches`: run Messages API requests in the workers' slack, within 24 hours."""

    model_config = ConfigDict(extra="forbid")

    requests: list[MessageBatchRequest] = Field(min_length=1, max_length=MAX_REQUESTS)
