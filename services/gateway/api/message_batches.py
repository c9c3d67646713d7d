"""Anthropic's Message Batches (`/v1/messages/batches`): the key in `x-api-key` (or `Authorization:
Bearer`: `deps.get_caller` on Anthropic's paths), the call admitted as any other and forwarded to
the session manager, which answers it (`services/sessions/batches/messages_router.py`); errors in
Anthropic's shape. The body is read whole, so a batch's requests together are bounded by
AXON_MAX_BODY_BYTES.
"""

from typing import Any

from fastapi import APIRouter, Request, Security
from fastapi.responses import Response

from services.gateway.api.deps import CallerDep, ServiceDep
from services.gateway.api.openapi import (
    anthropic_error_responses,
    anthropic_key_scheme,
    bearer_scheme,
    json_body,
    query,
)
from shared.message_batch_requests import MessageBatchCreate

# Either credential documents the routes (`CallerDep` checks them).
router = APIRouter(
    prefix="/v1/messages/batches", dependencies=[Security(bearer_scheme), Security(anthropic_key_scheme)]
)

_PAGE = [
    query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 20}, "Batches per page."),
    query("after_id", {"type": "string", "maxLength": 64}, "The page after this batch (older batches)."),
    query("before_id", {"type": "string", "maxLength": 64}, "The page before this batch (newer batches)."),
]
_RESULTS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "One JSON line per request: `{custom_id, result}`, `result.type` one of `succeeded` (with "
        "the `message`), `errored` (with the `error`), `canceled`, `expired`.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post("", responses=anthropic_error_responses(), openapi_extra=json_body(MessageBatchCreate))
async def create_message_batch(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Create a Message Batch: run Messages API requests in the workers' slack, within 24 hours."""
    return await service.call(request, caller)


@router.get("", responses=anthropic_error_responses(), openapi_extra={"parameters": _PAGE})
async def list_message_batches(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """List your Message Batches, newest first (`limit`, `after_id`, `before_id`)."""
    return await service.call(request, caller)


@router.get("/{message_batch_id}", responses=anthropic_error_responses())
async def get_message_batch(
    message_batch_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """Get one of your Message Batches: its processing status, request counts and results URL."""
    return await service.call(request, caller)


@router.post("/{message_batch_id}/cancel", responses=anthropic_error_responses())
async def cancel_message_batch(
    message_batch_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """Cancel one of your Message Batches: requests not started never run, running ones stop (`canceled`)."""
    return await service.call(request, caller)


@router.delete("/{message_batch_id}", responses=anthropic_error_responses())
async def delete_message_batch(
    message_batch_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """Delete one of your Message Batches that has ended, and its results."""
    return await service.call(request, caller)


@router.get(
    "/{message_batch_id}/results",
    response_class=Response,
    responses={**_RESULTS, **anthropic_error_responses()},
)
async def message_batch_results(
    message_batch_id: str, request: Request, caller: CallerDep, service: ServiceDep
) -> Response:
    """The results of one of your Message Batches that has ended, as JSONL, streamed."""
    return await service.call(request, caller)
