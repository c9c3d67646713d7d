"""What the gateway's OpenAPI schema says about the public routes: request bodies, query
parameters, the bearer key and the OpenAI error shape.

The public routes take the raw body and forward it unchanged; the session manager validates it
against its pydantic models (`services/sessions/protocol.py`, `services/sessions/api/sessions.py`).
Services do not import each other, so the bodies are described here as JSON Schema, documentation
only: nothing in the gateway validates against them. `tests/unit/gateway/test_gateway_openapi.py` fails
when they drift from the session manager's models.
"""

from typing import Any

from fastapi.security import HTTPBearer
from pydantic import BaseModel

# Documents `Authorization: Bearer <key>` as the routes' security scheme (`components.securitySchemes`).
# It never refuses anything itself (auto_error=False): `deps.get_caller` decides who is calling.
bearer_scheme = HTTPBearer(
    scheme_name="apiKey",
    bearerFormat="axk_…",
    description="An Axon API key (`axon keys create`), sent as `Authorization: Bearer <key>`.",
    auto_error=False,
)


def _nullable(schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None, **extra}


_STRINGS = {"anyOf": [{"type": "string"}, {"items": {"type": "string"}, "type": "array"}]}

_STREAM_OPTIONS = {
    "properties": {"include_usage": {"default": False, "type": "boolean"}},
    "type": "object",
}

# The sampling fields both completion endpoints take (`protocol._SamplingFields`).
_SAMPLING = {
    "model": {"maxLength": 256, "minLength": 1, "type": "string", "description": "A model name or alias."},
    "max_tokens": _nullable({"minimum": 1, "type": "integer"}),
    "temperature": _nullable({"maximum": 2.0, "minimum": 0.0, "type": "number"}),
    "top_p": _nullable({"exclusiveMinimum": 0.0, "maximum": 1.0, "type": "number"}),
    "top_k": _nullable({"minimum": -1, "type": "integer"}),
    "stop": {"anyOf": [*_STRINGS["anyOf"], {"type": "null"}], "default": None, "description": "Up to 4 stop strings."},
    "seed": _nullable({"type": "integer"}),
    "n": {
        "default": 1,
        "maximum": 1,
        "minimum": 1,
        "type": "integer",
        "description": "Only one choice per request is supported.",
    },
    "stream": {"default": False, "type": "boolean", "description": "Answer as server-sent events."},
    "stream_options": _nullable(_STREAM_OPTIONS),
}

_TEXT_PART = {
    "properties": {"type": {"type": "string"}, "text": _nullable({"type": "string"})},
    "required": ["type"],
    "type": "object",
}

_CHAT_MESSAGE = {
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool", "developer"], "type": "string"},
        "content": {
            "anyOf": [{"type": "string"}, {"items": _TEXT_PART, "type": "array"}, {"type": "null"}],
            "default": None,
            "description": "Text, or a list of text parts.",
        },
        "name": _nullable({"type": "string"}),
    },
    "required": ["role"],
    "type": "object",
}

CHAT_COMPLETION_REQUEST: dict[str, Any] = {
    "properties": {
        **_SAMPLING,
        "messages": {"items": _CHAT_MESSAGE, "minItems": 1, "type": "array"},
        "max_completion_tokens": _nullable({"minimum": 1, "type": "integer"}),
        "session_id": _nullable(
            {"type": "string"},
            description="Axon extension: prepend this session's history and store the new turn in it.",
        ),
    },
    "required": ["model", "messages"],
    "type": "object",
}

COMPLETION_REQUEST: dict[str, Any] = {
    "properties": {
        **_SAMPLING,
        "prompt": {**_STRINGS, "description": "One prompt (a string, or a list holding exactly one string)."},
    },
    "required": ["model", "prompt"],
    "type": "object",
}

SESSION_CREATE: dict[str, Any] = {
    "additionalProperties": False,
    "properties": {
        "title": _nullable({"maxLength": 200, "type": "string"}),
        "system_prompt": _nullable({"maxLength": 100_000, "type": "string"}),
        "model": _nullable({"maxLength": 256, "type": "string"}),
    },
    "type": "object",
}

SESSION_UPDATE: dict[str, Any] = {
    "additionalProperties": False,
    "properties": {"title": _nullable({"maxLength": 200, "type": "string"})},
    "type": "object",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, which every error of the API has."""

    error: ErrorDetail


def json_body(schema: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` describing a JSON request body the route reads raw."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A query parameter the route forwards without reading it."""
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_ERROR_STATUSES: dict[int | str, str] = {
    400: "Invalid request: the body or a parameter is wrong (`param` names it).",
    401: "Missing, unknown or revoked API key.",
    404: "Unknown model, or no such session for this key's tenant.",
    409: "The session is answering another request.",
    413: "The request body is too large.",
    429: "A rate limit of the key is exhausted; see `Retry-After` and `x-ratelimit-*`.",
    503: "Overloaded, or no worker serves the model; see `Retry-After`.",
    504: "The answer did not start before the request's deadline.",
    "4XX": "Any other client error (e.g. a wrong method).",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for the errors a route may answer: the ones every forwarded call may
    get (no valid key, a limit, the session manager down or late, any other client error) and
    `statuses`, all in OpenAI's shape."""
    every: tuple[int | str, ...] = (401, 429, 503, 504, "4XX")
    return {status: {"description": _ERROR_STATUSES[status], "model": ErrorResponse} for status in (*statuses, *every)}


COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion; with `stream: true`, server-sent events ending with `data: [DONE]`.",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            # OpenAPI 3.1: the schema of each event.
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string", "description": "A JSON chunk, or `[DONE]` at the end."}},
                    "required": ["data"],
                }
            },
        },
    },
    **error_responses(400, 404, 409, 413),
}
