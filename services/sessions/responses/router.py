"""OpenAI's Responses API (`/v1/responses`) on the caller's tenant (`responses/service.py`).

`POST /v1/responses` runs a completion, so it is a hot route like `/v1/chat/completions` (a client
that disconnects cancels an unstored response's job; a stored one runs on); the stored responses'
routes are FastAPI routes. Another tenant's response gets 404.
"""

import contextlib
from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from services.sessions.conversations.protocol import item_list
from services.sessions.deps import MAX_BODY_BYTES, CallerDep, ServicesDep, SessionServices, caller_from, services_of
from services.sessions.responses.protocol import response_not_found
from services.sessions.responses.service import ResponsesService
from services.sessions.responses.store import StoredResponse
from services.sessions.sse import SSE_HEADERS, StreamKeepAlive
from shared.disconnects import DisconnectWatch
from shared.errors import AxonError, InvalidRequest, invalid_request
from shared.hot_routes import HotRoute, read_body, send_json
from shared.internal_headers import Caller
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
    services = services_of(scope)
    service = services.responses
    caller = caller_from(scope)
    body = parse_response_create(await read_body(scope, receive, max_bytes=MAX_BODY_BYTES))
    if body.user is not None:
        bind_contextvars(user=body.user)
    await services.counted(
        PATH, body.model, _respond(service, body, caller=caller, scope=scope, receive=receive, send=send)
    )


async def _respond(
    service: ResponsesService, body: ResponseCreate, *, caller: Caller, scope: Scope, receive: Receive, send: Send
) -> int:
    """Run the response and write it (whole, or as events with `stream`); returns the status sent."""
    request_id = scope["state"]["request_id"]
    if not body.stream:
        watch = DisconnectWatch(scope, receive)
        try:
            response = await service.create(body, caller=caller, request_id=request_id)
        finally:
            watch.stop()
        await send_json(send, 200, orjson.dumps(response))
        return 200
    if body.background:  # runs on its own: the client follows its events in its chunk log
        created = await service.create(body, caller=caller, request_id=request_id)
        await _send_events(
            await service.replays.replay(caller.tenant, created["id"], starting_after=None), scope, receive, send
        )
        return 200
    prepared = await service.prepare(body, caller=caller)
    active = await service.start(prepared, caller=caller, request_id=request_id)
    watch = DisconnectWatch(scope, receive)
    keepalive = None
    if active.job.start_by is not None:  # queued for a model with no live worker
        keepalive = StreamKeepAlive(send, SSE_HEADERS)
    try:
        # Failures before any token get a real status, unless the head went out with a keep-alive.
        first, rest = await service.first_chunk(prepared, active, on_wait=keepalive.beat if keepalive else None)
    except AxonError as exc:
        if keepalive is None or not keepalive.started:
            raise
        await send({"type": "http.response.body", "body": service.failure(prepared, exc), "more_body": False})
        return 200
    finally:
        watch.stop()
    started = keepalive is not None and keepalive.started
    await _send_events(service.stream(prepared, active, first, rest), scope, receive, send, started=started)
    return 200


async def _send_events(
    events: AsyncGenerator[bytes], scope: Scope, receive: Receive, send: Send, *, started: bool = False
) -> None:
    """Send `events` as an SSE body (the head goes out right before the first piece, unless it was
    `started` already: the gateway reads them together); a client that leaves cancels the sending,
    and `events` is closed at once."""
    watch = DisconnectWatch(scope, receive)
    try:
        async with contextlib.aclosing(events):
            async for piece in events:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                    started = True
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        watch.stop()
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watch.stop()


HOT_ROUTES = [HotRoute("POST", PATH, _create)]


async def _stored(services: SessionServices, tenant: str, response_id: str) -> StoredResponse:
    stored = await services.responses.store.get(tenant, response_id)
    if stored is None:
        raise response_not_found()
    return stored


@router.get("/{response_id}", response_model=None)
async def get_response(
    response_id: str,
    caller: CallerDep,
    services: ServicesDep,
    stream: Annotated[bool, Query(description="Stream its events (replayed, then live until it ends).")] = False,
    starting_after: Annotated[
        int | None, Query(ge=-1, description="With stream: only the events after this sequence_number.")
    ] = None,
) -> dict[str, Any] | StreamingResponse:
    """A stored response (an unfinished one with its output so far), or with `stream` its events."""
    service = services.responses
    if not stream:
        return await service.current(caller.tenant, response_id)
    events = await service.replays.replay(caller.tenant, response_id, starting_after=starting_after)
    return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})


@router.delete("/{response_id}")
async def delete_response(response_id: str, caller: CallerDep, services: ServicesDep) -> dict[str, Any]:
    """Delete a stored response (a later `previous_response_id` naming it gets 404)."""
    if not await services.responses.store.delete(caller.tenant, response_id):
        raise response_not_found()
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post("/{response_id}/cancel")
async def cancel_response(response_id: str, caller: CallerDep, services: ServicesDep) -> dict[str, Any]:
    """Cancel an unfinished stored response, background or not (an Axon extension: OpenAI cancels
    only background ones); 400 for a finished one."""
    return await services.responses.cancel(caller.tenant, response_id)


@router.get("/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    caller: CallerDep,
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    after: Annotated[str | None, Query(max_length=64, description="id of the last item of the previous page")] = None,
) -> dict[str, Any]:
    """A stored response's input items, newest first unless `order=asc`."""
    items = (await _stored(services, caller.tenant, response_id)).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest("after: not an input item of this response.", param="after", code="invalid_value")
        items = items[ids.index(after) + 1 :]
    return item_list(items[:limit], has_more=len(items) > limit)
