"""Anthropic's Message Batches (`/v1/messages/batches`) on the caller's tenant (`batches/service.py`,
`batches/messages.py`): the routes only translate HTTP. Another tenant's batch, or an OpenAI batch,
is 404. Errors take Anthropic's shape on these paths (`shared/http_errors.py`).
"""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from services.sessions.batches.messages import (
    MESSAGE_BATCH_ID,
    message_batch_deleted,
    message_batch_list,
    message_batch_not_found,
    message_batch_object,
)
from services.sessions.batches.service import BatchService
from services.sessions.batches.store import BatchRecord
from services.sessions.deps import CallerDep, services_of
from shared.errors import InvalidRequest, NotFound
from shared.internal_headers import PUBLIC_URL_HEADER
from shared.logging import bind_contextvars
from shared.message_batch_requests import MessageBatchCreate

PREFIX = "/v1/messages/batches"
# Anthropic's page sizes.
MAX_PAGE = 1000


async def _bind_batch_id(request: Request) -> None:
    """Put the batch id on every log line of the request."""
    if batch_id := request.path_params.get("message_batch_id"):
        bind_contextvars(batch_id=batch_id)


router = APIRouter(prefix=PREFIX, dependencies=[Depends(_bind_batch_id)])


def _service(request: Request) -> BatchService:
    return services_of(request.scope).batches


def _known(batch_id: str) -> str:
    if not MESSAGE_BATCH_ID.match(batch_id):
        raise message_batch_not_found(batch_id)
    return batch_id


def _object(request: Request, record: BatchRecord) -> dict[str, Any]:
    """The batch's object, its `results_url` under the public address the gateway was called at (or,
    called directly, the path alone)."""
    base = request.headers.get(PUBLIC_URL_HEADER, "").rstrip("/")
    return message_batch_object(record, results_url=f"{base}{PREFIX}/{record.id}/results")


@router.post("")
async def create_message_batch(body: MessageBatchCreate, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Create a message batch of the body's requests."""
    return _object(request, await _service(request).create_messages(body, caller=caller))


@router.get("")
async def list_message_batches(
    caller: CallerDep,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
    after_id: Annotated[str | None, Query(max_length=64)] = None,
    before_id: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    """List your message batches, newest first."""
    if any(cursor is not None and not MESSAGE_BATCH_ID.match(cursor) for cursor in (after_id, before_id)):
        return message_batch_list([], has_more=False)
    records, has_more = await _service(request).store.message_page(
        caller.tenant, after_id=after_id, before_id=before_id, limit=limit
    )
    return message_batch_list([_object(request, r) for r in records], has_more=has_more)


@router.get("/{message_batch_id}")
async def get_message_batch(message_batch_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Get one of your message batches."""
    return _object(request, await _service(request).get_messages(caller.tenant, _known(message_batch_id)))


@router.post("/{message_batch_id}/cancel")
async def cancel_message_batch(message_batch_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Cancel one of your message batches."""
    return _object(request, await _service(request).cancel_messages(caller.tenant, _known(message_batch_id)))


@router.delete("/{message_batch_id}")
async def delete_message_batch(message_batch_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Delete one of your message batches that has ended, and its results."""
    await _service(request).delete_messages(caller.tenant, _known(message_batch_id))
    return message_batch_deleted(message_batch_id)


@router.get("/{message_batch_id}/results")
async def message_batch_results(message_batch_id: str, caller: CallerDep, request: Request) -> StreamingResponse:
    """The results of one of your message batches that has ended, as JSONL, streamed."""
    service = _service(request)
    record = await service.get_messages(caller.tenant, _known(message_batch_id))
    if not record.terminal:
        raise InvalidRequest(
            f"Message batch {message_batch_id} is still processing: its results are ready once it has ended.",
            param="message_batch_id",
        )
    results = await service.results(caller.tenant, record)
    if results is None:
        raise NotFound(f"The results of message batch {message_batch_id} are no longer available.")
    size, pieces = results
    # Content-Length: a download cut short is seen as such (the gateway streams it through).
    return StreamingResponse(pieces, media_type="application/octet-stream", headers={"content-length": str(size)})
