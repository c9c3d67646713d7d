"""OpenAI's Responses API (`/v1/responses`) on the caller's tenant (`services/sessions/responses_api.py`).

`POST /v1/responses` runs a completion, so it is a hot route like `/v1/chat/completions` (a client
that disconnects cancels its job); the stored responses' routes are FastAPI routes. Another
tenant's response gets 404.
"""

import asyncio
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Query, Request
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from services.sessions.api.deps import CallerDep, caller_from
from services.sessions.api.routes import MAX_BODY_BYTES
from services.sessions.conversations import item_list
from services.sessions.responses_api import ResponsesService, StoredResponse, response_not_found
from shared.disconnects import DisconnectWatch
from shared.errors import AxonError, InvalidRequest, ModelNotFound, invalid_request
from shared.hot_routes import HotRoute, read_body, send_json
from shared.logging import bind_contextvars
from shared.responses_requests import ResponseCreate

PATH = "/v1/responses"
router = APIRouter(prefix=PATH)


def parse_response_create(raw: bytes) -> ResponseCreate:
    """The body of `POST /v1/responses`, validated.

    Raises:
        InvalidRequest: not valid JSON, or a field breaks a rule (`param` names it).
    """
    try:
        body = ResponseCreate.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_request(exc.errors(include_url=False)) from None
    return body


async def _create(scope: Scope, receive: Receive, send: Send) -> None:
    service: ResponsesService = scope["app"].state.responses
    metrics = scope["app"].state.metrics
    caller = caller_from(scope)
    body = parse_response_create(await read_body(scope, receive, max_bytes=MAX_BODY_BYTES))
    if body.stream:
        raise InvalidRequest("stream: true is not supported yet.", param="stream", code="unsupported_parameter")
    if body.user is not None:
        bind_contextvars(user=body.user)
    status, model = 500, body.model
    watch = DisconnectWatch(scope, receive)
    try:
        response = await service.create(body, caller=caller, request_id=scope["state"]["request_id"])
        watch.stop()
        await send_json(send, 200, orjson.dumps(response))
        status = 200
    except AxonError as exc:
        status = exc.status_code
        model = "unknown" if isinstance(exc, ModelNotFound) else model
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away (or the process is stopping)
        raise
    finally:
        watch.stop()
        metrics.completion_requests.labels(PATH, model, str(status)).inc()


HOT_ROUTES = [HotRoute("POST", PATH, _create)]


def _service(request: Request) -> ResponsesService:
    service: ResponsesService = request.app.state.responses
    return service


async def _stored(request: Request, tenant: str, response_id: str) -> StoredResponse:
    stored = await _service(request).store.get(tenant, response_id)
    if stored is None:
        raise response_not_found()
    return stored


@router.get("/{response_id}")
async def get_response(response_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """A stored response."""
    return (await _stored(request, caller.tenant, response_id)).response


@router.delete("/{response_id}")
async def delete_response(response_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Delete a stored response (a later `previous_response_id` naming it gets 404)."""
    if not await _service(request).store.delete(caller.tenant, response_id):
        raise response_not_found()
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post("/{response_id}/cancel")
async def cancel_response(response_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Cancel a background response. Every stored response is finished (background ones are not
    supported yet), so this answers 400 as OpenAI does for a finished one."""
    await _stored(request, caller.tenant, response_id)
    raise InvalidRequest("Only background responses can be cancelled.", param="response_id", code="invalid_value")


@router.get("/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    caller: CallerDep,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    after: Annotated[str | None, Query(max_length=64, description="id of the last item of the previous page")] = None,
) -> dict[str, Any]:
    """A stored response's input items, newest first unless `order=asc`."""
    items = (await _stored(request, caller.tenant, response_id)).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest("after: not an input item of this response.", param="after", code="invalid_value")
        items = items[ids.index(after) + 1 :]
    return item_list(items[:limit], has_more=len(items) > limit)
