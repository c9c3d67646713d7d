"""What the gateway's OpenAPI schema says about the public routes: request bodies, query
parameters, the bearer key and the OpenAI error shape; and its sections (tags), the admin API's
among them.

The public routes take the raw body and forward it unchanged; the session manager validates it.
The bodies are documented from the very models it validates them with (`shared/openai_requests.py`,
`shared/session_requests.py`, `shared/conversation_requests.py`,
`shared/responses_requests.py`, `shared/batch_requests.py`): their JSON Schemas, each model a
named schema under `components.schemas` (`install_request_schemas`). Nothing in the gateway
validates against them.
"""

from typing import Any

from fastapi import FastAPI
from fastapi.security import APIKeyHeader, HTTPBearer
from pydantic import BaseModel

from shared.anthropic_errors import OVERLOADED_STATUS
from shared.batch_requests import BatchCreate
from shared.conversation_requests import ConversationCreate, ConversationItemsCreate, ConversationUpdate
from shared.message_batch_requests import MessageBatchCreate
from shared.messages_requests import CountTokensRequest, MessageCreate
from shared.openai_requests import ChatCompletionRequest, CompletionRequest
from shared.responses_requests import ResponseCreate
from shared.session_requests import SessionCreate, SessionUpdate

# Documents `Authorization: Bearer <key>` as the routes' security scheme (`components.securitySchemes`).
# It never refuses anything itself (auto_error=False): `deps.get_caller` decides who is calling.
bearer_scheme = HTTPBearer(
    scheme_name="apiKey",
    bearerFormat="axk_…",
    description="An Axon API key (`axon keys create`), sent as `Authorization: Bearer <key>`.",
    auto_error=False,
)

# Anthropic's routes also take the key as Anthropic's clients send it; `deps.get_caller` and
# `GatewayService.messages` check it.
anthropic_key_scheme = APIKeyHeader(
    name="x-api-key",
    scheme_name="anthropicApiKey",
    description="An Axon API key as Anthropic's clients send it, on the Messages routes (`/v1/messages...`).",
    auto_error=False,
)

# The admin API's credential (`AXON_ADMIN_TOKEN`), documented like the key; `deps.require_admin` checks it.
admin_bearer_scheme = HTTPBearer(
    scheme_name="adminToken",
    description="The admin token (`AXON_ADMIN_TOKEN`), sent as `Authorization: Bearer <token>`.",
    auto_error=False,
)

# The document's sections, in the order /docs shows them.
TAGS: list[dict[str, Any]] = [
    {"name": "Chat", "description": "Chat completions (OpenAI's), and resuming a session turn's stream."},
    {"name": "Completions", "description": "Text completions (OpenAI's legacy API)."},
    {"name": "Responses", "description": "OpenAI's Responses API: stored, background and streamed responses."},
    {"name": "Conversations", "description": "OpenAI's Conversations API (a conversation is a session)."},
    {
        "name": "Messages",
        "description": "Anthropic's Messages API (the `anthropic` SDK's `base_url`: the gateway): messages, "
        "streamed or whole, with tools, and token counts. Errors there are in Anthropic's shape.",
    },
    {"name": "Sessions", "description": "Axon's sessions: history kept by the server, per tenant."},
    {"name": "Models", "description": "The models live workers serve, and aliases."},
    {"name": "Files", "description": "OpenAI's Files API: the input and output files of batches."},
    {"name": "Batches", "description": "OpenAI's Batch API: requests run in the workers' slack, within a window."},
    {
        "name": "Admin",
        "description": "API keys, tenants' weights, usage and model aliases (the admin token, not an API key).",
    },
    {"name": "Operations", "description": "Liveness, readiness and Prometheus metrics."},
]
# The section of a route, by the start of its path (the first that matches).
_TAG_OF_PATH = (
    ("/v1/chat/", "Chat"),
    ("/v1/completions", "Completions"),
    ("/v1/responses", "Responses"),
    ("/v1/conversations", "Conversations"),
    ("/v1/messages", "Messages"),
    ("/v1/sessions", "Sessions"),
    ("/v1/models", "Models"),
    ("/v1/files", "Files"),
    ("/v1/batches", "Batches"),
    ("/admin/", "Admin"),
    ("/health", "Operations"),
    ("/ready", "Operations"),
    ("/metrics", "Operations"),
)


def install_tags(app: FastAPI) -> None:
    """Put every operation of `app`'s OpenAPI document in its section (`TAGS`), found by its path,
    unless its route names one: the sections of /docs, rather than one "default".

    Raises (when the document is built):
        RuntimeError: an operation's path belongs to no section.
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            for path, operations in generate()["paths"].items():
                tag = next((tag for prefix, tag in _TAG_OF_PATH if path.startswith(prefix)), None)
                if tag is None:
                    raise RuntimeError(f"{path} is in no section of the API document")
                for operation in operations.values():
                    operation.setdefault("tags", [tag])
        return generate()

    app.openapi = openapi  # type: ignore[method-assign]


_COMPONENT = "#/components/schemas/{model}"
_BODY_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    SessionCreate,
    SessionUpdate,
    ConversationCreate,
    ConversationUpdate,
    ConversationItemsCreate,
    ResponseCreate,
    BatchCreate,
    MessageCreate,
    CountTokensRequest,
    MessageBatchCreate,
)


def _request_components() -> dict[str, Any]:
    """Every body model's JSON Schema and the models it uses, by name."""
    components: dict[str, Any] = {}
    for model in _BODY_MODELS:
        schema = model.model_json_schema(ref_template=_COMPONENT)
        for name, definition in {**schema.pop("$defs", {}), model.__name__: schema}.items():
            if components.setdefault(name, definition) != definition:
                raise RuntimeError(f"two request schemas are named {name}")
    return components


REQUEST_COMPONENTS = _request_components()


def install_request_schemas(app: FastAPI) -> None:
    """Add the body models' schemas to `app`'s OpenAPI document (`components.schemas`), which
    `json_body` refers to."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schemas = generate().setdefault("components", {}).setdefault("schemas", {})
            if clash := schemas.keys() & REQUEST_COMPONENTS.keys():
                raise RuntimeError(f"request schemas named like other components: {sorted(clash)}")
            schemas.update(REQUEST_COMPONENTS)
        return generate()

    app.openapi = openapi  # type: ignore[method-assign]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, which every error of the API has."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape, which every error of the Messages routes has."""

    type: str
    error: AnthropicErrorDetail


def json_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` describing a JSON request body the route reads raw: one of `model`."""
    schema = {"$ref": _COMPONENT.format(model=model.__name__)}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A query parameter the route forwards without reading it."""
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_ERROR_STATUSES: dict[int | str, str] = {
    400: "Invalid request: the body or a parameter is wrong (`param` names it).",
    401: "Missing, unknown or revoked API key.",
    404: "Unknown model, or no such session, conversation, item, response, file or batch for this key's tenant.",
    409: "The session is answering another request.",
    413: "The request body is too large (a file: larger than AXON_FILE_MAX_BYTES).",
    429: "A rate limit of the key is exhausted; see `Retry-After` and `x-ratelimit-*`.",
    503: "Overloaded, or no worker serves the model; see `Retry-After`.",
    504: "The answer did not start before the request's deadline.",
    "4XX": "Any other client error (e.g. a wrong method).",
}


_ADMIN_ERROR_STATUSES: dict[int | str, str] = {
    400: "Invalid request: the body or a parameter is wrong (`param` names it).",
    401: "Missing or incorrect admin token.",
    404: "No such active key, or no such alias.",
    409: "No live worker serves the alias's target.",
    "4XX": "Any other client error (e.g. a wrong method).",
}


def admin_error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for an admin route's errors: a wrong token, any other client error,
    and `statuses`, all in OpenAI's shape."""
    every: tuple[int | str, ...] = (401, "4XX")
    return {
        status: {"description": _ADMIN_ERROR_STATUSES[status], "model": ErrorResponse} for status in (*statuses, *every)
    }


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for the errors a route may answer: the ones every forwarded call may
    get (no valid key, a limit, the session manager down or late, any other client error) and
    `statuses`, all in OpenAI's shape."""
    every: tuple[int | str, ...] = (401, 429, 503, 504, "4XX")
    return {status: {"description": _ERROR_STATUSES[status], "model": ErrorResponse} for status in (*statuses, *every)}


_ANTHROPIC_ERROR_STATUSES: dict[int | str, str] = {
    400: "`invalid_request_error`: the body is wrong (the message starts with the field), or asks for what the "
    "model cannot do.",
    401: "`authentication_error`: missing, unknown or revoked API key.",
    403: "`permission_error`: the key may not use the model.",
    404: "`not_found_error`: unknown model.",
    413: "`request_too_large`: the request body is too large.",
    429: "`rate_limit_error`: a rate limit of the key is exhausted; see `retry-after` and `anthropic-ratelimit-*`.",
    503: "`overloaded_error`: no worker serves the model now, or a part of the platform is away; see `retry-after`.",
    504: "`timeout_error`: the answer did not start before the request's deadline.",
    OVERLOADED_STATUS: "`overloaded_error`: the platform is full (the model's queue, the gateway's requests in "
    "flight); see `retry-after`.",
    "4XX": "Any other client error (e.g. a wrong method).",
}


def anthropic_error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for a Messages route's errors, in Anthropic's shape: the ones every
    call may get and `statuses`."""
    every: tuple[int | str, ...] = (400, 401, 403, 404, 413, 429, 503, 504, OVERLOADED_STATUS, "4XX")
    return {
        status: {"description": _ANTHROPIC_ERROR_STATUSES[status], "model": AnthropicErrorResponse}
        for status in (*statuses, *every)
    }


MESSAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The Message; with `stream: true`, Anthropic's server-sent events from `message_start` to "
        "`message_stop` (or an `error` event).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "event": {"type": "string", "description": "The event's type."},
                        "data": {"type": "string", "description": "The event as JSON."},
                    },
                }
            },
        },
    },
    **anthropic_error_responses(),
}
COUNT_TOKENS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The prompt's tokens, as the model's engine counts them.",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
                    "required": ["input_tokens"],
                }
            }
        },
    },
    **anthropic_error_responses(),
}


COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion or response; with `stream: true`, server-sent events ending with "
        "`data: [DONE]` (a response's: with `response.completed`, `response.incomplete` or `response.failed`).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            # OpenAPI 3.1: the schema of each event.
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "data": {"type": "string", "description": "A JSON chunk or event, or `[DONE]` at the end."}
                    },
                    "required": ["data"],
                }
            },
        },
    },
    **error_responses(400, 404, 409, 413),
}
