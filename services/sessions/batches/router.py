"""OpenAI's Batch API (`/v1/batches`) on the caller's tenant (`batches/service.py`): the routes
only translate HTTP. Another tenant's batch gets 404."""

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from services.sessions.batches.protocol import batch_list, batch_not_found, batch_object
from services.sessions.batches.service import BatchService
from services.sessions.deps import CallerDep, services_of
from shared.batch_requests import BatchCreate
from shared.logging import bind_contextvars

# What `new_batch_id` makes: anything else names no batch (and never reaches PostgreSQL).
_BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")


async def _bind_batch_id(request: Request) -> None:
    """Put the batch id on every log line of the request."""
    if batch_id := request.path_params.get("batch_id"):
        bind_contextvars(batch_id=batch_id)


router = APIRouter(prefix="/v1/batches", dependencies=[Depends(_bind_batch_id)])


def _service(request: Request) -> BatchService:
    return services_of(request.scope).batches


def _known(batch_id: str) -> str:
    if not _BATCH_ID.match(batch_id):
        raise batch_not_found(batch_id)
    return batch_id


@router.post("")
async def create_batch(body: BatchCreate, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Create a batch from an uploaded file of requests (`purpose=batch`)."""
    return batch_object(await _service(request).create(body, caller=caller))


@router.get("")
async def list_batches(
    caller: CallerDep,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=64, description="id of the last batch of the previous page")] = None,
) -> dict[str, Any]:
    """List your batches, newest first."""
    if after is not None and not _BATCH_ID.match(after):
        return batch_list([], has_more=False)
    records, has_more = await _service(request).store.page(caller.tenant, after=after, limit=limit)
    return batch_list(records, has_more)


@router.get("/{batch_id}")
async def get_batch(batch_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Get one of your batches."""
    return batch_object(await _service(request).get(caller.tenant, _known(batch_id)))


@router.post("/{batch_id}/cancel")
async def cancel_batch(batch_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Cancel one of your batches."""
    return batch_object(await _service(request).cancel(caller.tenant, _known(batch_id)))
