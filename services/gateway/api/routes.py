"""Public API routes: the caller is authenticated by `CallerDep`; the service admits and forwards.

The routes read bodies raw and forward them; the OpenAPI schema describes them with the session
manager's own models (`api/openapi.py`).
The completion routes are answered by `GatewayService.completion` ahead of FastAPI
(`HOT_ROUTES`), and documented from the same declarations.
"""

from typing import Any

from fastapi import APIRouter, Request, Security
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from services.gateway.api.deps import CallerDep, ServiceDep
from services.gateway.api.openapi import (
    COMPLETION_RESPONSES,
    COUNT_TOKENS_RESPONSES,
    MESSAGE_RESPONSES,
    anthropic_key_scheme,
    bearer_scheme,
    error_responses,
    json_body,
    query,
)
from shared.batch_requests import BatchCreate
from shared.conversation_requests import ConversationCreate, ConversationItemsCreate, ConversationUpdate
from shared.files_api import LIST_MAX, FileDeleted, FileList, FileObject, upload_form_schema
from shared.hot_routes import HotRoute, document
from shared.messages_requests import CountTokensRequest, MessageCreate
from shared.openai_requests import ChatCompletionRequest, CompletionRequest
from shared.responses_requests import ResponseCreate
from shared.session_requests import SessionCreate, SessionUpdate
from shared.url_params import ANY

# The bearer scheme only documents the key in the schema; `CallerDep` checks it.
router = APIRouter(dependencies=[Security(bearer_scheme)])

_PAGE_SESSIONS = [
    query("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}, "Sessions per page."),
    query("after", {"type": "string", "maxLength": 64}, "Id of the last session of the previous page."),
]
_PAGE_MESSAGES = [
    query("limit", {"type": "integer", "minimum": 1, "maximum": 500, "default": 100}, "Messages per page."),
    query("after", {"type": "integer", "minimum": 0, "default": 0}, "`seq` of the last message of the previous page."),
]
_PAGE_ITEMS = [
    query("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}, "Items per page."),
    query("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}, "Oldest (`asc`) or newest first."),
    query("after", {"type": "string", "maxLength": 64}, "Id of the last item of the previous page."),
]


async def _completion(scope: Scope, receive: Receive, send: Send) -> None:
    await scope["app"].state.gateway.completion(scope, receive, send)


def _completion_route(path: str, name: str, what: str, body: type[BaseModel]) -> HotRoute:
    """A completion route, answered by `_completion` and documented from `body`'s model."""
    return HotRoute(
        "POST",
        path,
        _completion,
        openapi={
            "responses": COMPLETION_RESPONSES,
            "openapi_extra": json_body(body),
            "summary": name.replace("_", " ").title(),
            "description": f"Create a {what} (OpenAI-compatible; `stream: true` for server-sent events).",
            "operation_id": f"{name}{path.replace('/', '_')}_post",
        },
    )


async def _messages(scope: Scope, receive: Receive, send: Send) -> None:
    await scope["app"].state.gateway.messages(scope, receive, send)


def _messages_route(path: str, name: str, description: str, body: type[BaseModel]) -> HotRoute:
    """One of Anthropic's Messages routes, answered by `_messages` and documented from `body`'s model."""
    return HotRoute(
        "POST",
        path,
        _messages,
        openapi={
            "responses": COUNT_TOKENS_RESPONSES if body is CountTokensRequest else MESSAGE_RESPONSES,
            "openapi_extra": json_body(body),
            "summary": name.replace("_", " ").title(),
            "description": description,
            "operation_id": f"{name}{path.replace('/', '_')}_post",
            "dependencies": [Security(anthropic_key_scheme)],
        },
    )


HOT_ROUTES = [
    _completion_route("/v1/chat/completions", "chat_completions", "chat completion", ChatCompletionRequest),
    _completion_route("/v1/completions", "completions", "text completion", CompletionRequest),
    _completion_route("/v1/responses", "responses", "response (OpenAI's Responses API)", ResponseCreate),
    _messages_route(
        "/v1/messages",
        "messages",
        "Create a Message (Anthropic's Messages API; `stream: true` for Anthropic's server-sent events). The key "
        "in `x-api-key` or `Authorization: Bearer`; `anthropic-version` is accepted.",
        MessageCreate,
    ),
    _messages_route(
        "/v1/messages/count_tokens",
        "count_message_tokens",
        "Count a Messages request's input tokens with the model's own tokenizer and chat template (Anthropic's).",
        CountTokensRequest,
    ),
]
"""The completion routes: plain ASGI handlers ahead of FastAPI (`shared.hot_routes.HotRoutes`),
each declared once: `document` puts it in the OpenAPI document from the same declaration."""
document(router, HOT_ROUTES)


_RESUME_STREAM = [
    query("starting_after", {"type": "integer", "minimum": -1}, "Id of the last event received (or Last-Event-ID)."),
]


@router.get(
    "/v1/chat/completions/{completion_id}/stream",
    responses=error_responses(400, 404),
    openapi_extra={"parameters": _RESUME_STREAM},
)
async def resume_chat_completion_stream(
    completion_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """The rest of a session turn's streamed chat completion (`chatcmpl-...`), after the event the
    `Last-Event-ID` header (or `starting_after`) names, live until it ends (an Axon extension)."""
    return await service.call(request, caller)


@router.get("/v1/models", responses=error_responses())
async def list_models(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """List the models that live workers serve, with their context length and capabilities."""
    return await service.call(request, caller)


@router.get(f"/v1/models/{{model_id:{ANY}}}", responses=error_responses(404))
async def get_model(model_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """One model (or alias) live workers serve: its context length and the parameters they honour."""
    return await service.call(request, caller)


@router.post(
    "/v1/sessions", status_code=201, responses=error_responses(400, 413), openapi_extra=json_body(SessionCreate)
)
async def create_session(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Create a session (optional `title`, `system_prompt`, `model`)."""
    return await service.call(request, caller)


@router.get("/v1/sessions", responses=error_responses(400), openapi_extra={"parameters": _PAGE_SESSIONS})
async def list_sessions(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """List your sessions, newest first (`limit`, `after`)."""
    return await service.call(request, caller)


@router.get("/v1/sessions/{session_id}", responses=error_responses(404))
async def get_session(session_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Get one of your sessions."""
    return await service.call(request, caller)


@router.patch(
    "/v1/sessions/{session_id}", responses=error_responses(400, 404, 413), openapi_extra=json_body(SessionUpdate)
)
async def update_session(session_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Rename one of your sessions (`title`)."""
    return await service.call(request, caller)


@router.delete("/v1/sessions/{session_id}", responses=error_responses(404))
async def delete_session(session_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Delete one of your sessions and all its messages."""
    return await service.call(request, caller)


@router.get(
    "/v1/sessions/{session_id}/messages",
    responses=error_responses(400, 404),
    openapi_extra={"parameters": _PAGE_MESSAGES},
)
async def list_session_messages(session_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """List a session's messages, oldest first (`limit`, `after`)."""
    return await service.call(request, caller)


@router.post("/v1/conversations", responses=error_responses(400, 413), openapi_extra=json_body(ConversationCreate))
async def create_conversation(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Create a conversation (OpenAI's Conversations API; a session), with up to 20 initial `items` and `metadata`."""
    return await service.call(request, caller)


@router.get("/v1/conversations/{conversation_id}", responses=error_responses(404))
async def get_conversation(conversation_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Get one of your conversations (`conv_<hex>`, or its session's id)."""
    return await service.call(request, caller)


@router.post(
    "/v1/conversations/{conversation_id}",
    responses=error_responses(400, 404, 413),
    openapi_extra=json_body(ConversationUpdate),
)
async def update_conversation(
    conversation_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """Replace one of your conversations' `metadata`."""
    return await service.call(request, caller)


@router.delete("/v1/conversations/{conversation_id}", responses=error_responses(404))
async def delete_conversation(
    conversation_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """Delete one of your conversations (its session) and all its items."""
    return await service.call(request, caller)


@router.get(
    "/v1/conversations/{conversation_id}/items",
    responses=error_responses(400, 404),
    openapi_extra={"parameters": _PAGE_ITEMS},
)
async def list_conversation_items(
    conversation_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """List a conversation's items, newest first unless `order=asc` (`limit`, `after`)."""
    return await service.call(request, caller)


@router.post(
    "/v1/conversations/{conversation_id}/items",
    responses=error_responses(400, 404, 413),
    openapi_extra=json_body(ConversationItemsCreate),
)
async def create_conversation_items(
    conversation_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """Add up to 20 items to a conversation (`message`, `function_call`, `function_call_output`)."""
    return await service.call(request, caller)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=error_responses(404))
async def get_conversation_item(
    conversation_id: str, item_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """Get one item of a conversation."""
    return await service.call(request, caller)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}", responses=error_responses(404))
async def delete_conversation_item(
    conversation_id: str, item_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """Delete one item of a conversation; answers the conversation."""
    return await service.call(request, caller)


_PAGE_INPUT_ITEMS = [
    query("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}, "Items per page."),
    query("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}, "Oldest (`asc`) or newest first."),
    query("after", {"type": "string", "maxLength": 64}, "Id of the last item of the previous page."),
]


_STREAM_RESPONSE = [
    query("stream", {"type": "boolean", "default": False}, "Stream its events: replayed, then live until it ends."),
    query("starting_after", {"type": "integer", "minimum": -1}, "With stream: the events after this sequence_number."),
]


@router.get(
    "/v1/responses/{response_id}", responses=error_responses(400, 404), openapi_extra={"parameters": _STREAM_RESPONSE}
)
async def get_response(response_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Get one of your stored responses (`resp_<hex>`; an unfinished one with its output so far),
    or with `stream=true` its events from the first (or after `starting_after`), live until it ends."""
    return await service.call(request, caller)


@router.delete("/v1/responses/{response_id}", responses=error_responses(404))
async def delete_response(response_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Delete one of your stored responses."""
    return await service.call(request, caller)


@router.post("/v1/responses/{response_id}/cancel", responses=error_responses(400, 404))
async def cancel_response(response_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Cancel an unfinished background response; a finished one, or one not created in the background, is 400."""
    return await service.call(request, caller)


@router.get(
    "/v1/responses/{response_id}/input_items",
    responses=error_responses(400, 404),
    openapi_extra={"parameters": _PAGE_INPUT_ITEMS},
)
async def list_response_input_items(
    response_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """List a stored response's input items, newest first unless `order=asc` (`limit`, `after`)."""
    return await service.call(request, caller)


_PAGE_FILES = [
    query("purpose", {"type": "string", "maxLength": 64}, "Only files of this purpose."),
    query("limit", {"type": "integer", "minimum": 1, "maximum": LIST_MAX, "default": LIST_MAX}, "Files per page."),
    query("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}, "Oldest (`asc`) or newest first."),
    query("after", {"type": "string", "maxLength": 64}, "Id of the last file of the previous page."),
]
_UPLOAD = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": upload_form_schema()}}}}
_FILE_CONTENT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The file's bytes, as uploaded.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post("/v1/files", response_model=FileObject, responses=error_responses(400, 413), openapi_extra=_UPLOAD)
async def create_file(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Upload a file (multipart: `purpose`, optional `expires_after`, then `file`), streamed through;
    at most AXON_FILE_MAX_BYTES (200 MB by default)."""
    return await service.call(request, caller, upload=True)


@router.get(
    "/v1/files", response_model=FileList, responses=error_responses(400), openapi_extra={"parameters": _PAGE_FILES}
)
async def list_files(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """List your files, newest first unless `order=asc` (`purpose`, `limit`, `after`)."""
    return await service.call(request, caller)


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=error_responses(404))
async def get_file(file_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Get one of your files."""
    return await service.call(request, caller)


@router.get("/v1/files/{file_id}/content", response_class=Response, responses={**_FILE_CONTENT, **error_responses(404)})
async def get_file_content(file_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Download one of your files' content, streamed."""
    return await service.call(request, caller)


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=error_responses(404))
async def delete_file(file_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Delete one of your files."""
    return await service.call(request, caller)


_PAGE_BATCHES = [
    query("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}, "Batches per page."),
    query("after", {"type": "string", "maxLength": 64}, "Id of the last batch of the previous page."),
]


@router.post("/v1/batches", responses=error_responses(400, 404, 413), openapi_extra=json_body(BatchCreate))
async def create_batch(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Create a batch: run every request of an uploaded JSONL file (`purpose=batch`) within `completion_window`."""
    return await service.call(request, caller)


@router.get("/v1/batches", responses=error_responses(400), openapi_extra={"parameters": _PAGE_BATCHES})
async def list_batches(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """List your batches, newest first (`limit`, `after`)."""
    return await service.call(request, caller)


@router.get("/v1/batches/{batch_id}", responses=error_responses(404))
async def get_batch(batch_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Get one of your batches: its status, request counts and output and error files."""
    return await service.call(request, caller)


@router.post("/v1/batches/{batch_id}/cancel", responses=error_responses(400, 404))
async def cancel_batch(batch_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Cancel one of your batches: lines not started never run, running ones stop; the rest is in its error file."""
    return await service.call(request, caller)
