"""The chat and text completion routes (`/v1/chat/completions`, `/v1/completions`) and a session
turn's stream resume: they only translate between HTTP and the service.

The completion routes, which every generated token takes, are plain ASGI handlers ahead of
FastAPI (`HOT_ROUTES`, installed with `shared.hot_routes.HotRoutes`); the resume route is a FastAPI
route.
"""

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from services.sessions.chat.resume import open_chat_stream
from services.sessions.deps import MAX_BODY_BYTES, CallerDep, ServicesDep, SessionServices, caller_from, services_of
from services.sessions.sse import SSE_HEADERS, StreamKeepAlive, sse_error
from shared.disconnects import DisconnectWatch
from shared.errors import AxonError
from shared.hot_routes import HotRoute, read_body, send_json
from shared.http_responses import SSE_END
from shared.internal_headers import Caller
from shared.logging import bind_contextvars
from shared.openai_requests import ChatCompletionRequest, CompletionRequest, Kind, parse_request
from shared.tracing import span

router = APIRouter()


def _hot_completion(kind: Kind) -> HotRoute:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        services = services_of(scope)
        caller = caller_from(scope)
        body = parse_request(kind, await read_body(scope, receive, max_bytes=MAX_BODY_BYTES), services.request_limits)
        await services.counted(
            path,
            body.model,
            _complete(services, body, kind=kind, caller=caller, scope=scope, receive=receive, send=send),
        )

    return HotRoute("POST", path, handler)


async def _complete(
    services: SessionServices,
    body: ChatCompletionRequest | CompletionRequest,
    *,
    kind: Kind,
    caller: Caller,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> int:
    """Run the completion and write the answer; returns the status sent."""
    if isinstance(body, ChatCompletionRequest) and body.session_id is not None:
        bind_contextvars(session_id=body.session_id)
    if body.user is not None:
        bind_contextvars(user=body.user)
    service, chat, tracing = services.completions, services.chat, services.tracing
    active = await service.start(body, kind=kind, caller=caller, request_id=scope["state"]["request_id"])
    watch = DisconnectWatch(scope, receive)
    try:
        extra = [(name.encode(), value.encode()) for name, value in active.headers().items()]
        keepalive = None
        if body.stream and active.job.start_by is not None:  # queued for a model with no live worker
            keepalive = StreamKeepAlive(send, SSE_HEADERS + extra)
        try:
            with span(tracing, "first chunk"):
                first, rest = await service.first_chunk(active, on_wait=keepalive.beat if keepalive else None)
        except AxonError as exc:
            if keepalive is None or not keepalive.started:
                raise
            watch.stop()
            await send({"type": "http.response.body", "body": sse_error(exc), "more_body": False})
            return 200
        # The worker's final chunk links this span to the worker's (`ActiveRequest.receive`).
        with span(tracing, "relay"):
            if not body.stream:
                answer = await chat.collect(active, first, rest)
                watch.stop()
                await send_json(send, 200, orjson.dumps(answer), extra)
                return 200
            started = keepalive is not None and keepalive.started
            async for piece in chat.sse(active, first, rest):
                if not started:  # the head goes out right before the first piece: the gateway reads them together
                    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + extra})
                    started = True
                ended = piece.endswith(SSE_END)
                if ended:
                    watch.stop()
                await send({"type": "http.response.body", "body": piece, "more_body": not ended})
            return 200
    finally:
        watch.stop()


HOT_ROUTES = [_hot_completion("chat"), _hot_completion("completion")]


@router.get("/v1/chat/completions/{completion_id}/stream")
async def resume_chat_stream(
    completion_id: str, request: Request, caller: CallerDep, services: ServicesDep, starting_after: str | None = None
) -> Response:
    """The rest of a session turn's streamed chat completion after the event `starting_after` (or
    the `Last-Event-ID` header; neither: from the start), live until it ends, from any replica."""
    events = await open_chat_stream(
        services.chunk_log,
        completion_id,
        tenant=caller.tenant,
        starting_after=starting_after,
        last_event_id=request.headers.get("last-event-id"),
    )
    headers = {name.decode(): value.decode() for name, value in SSE_HEADERS if name != b"content-type"}
    return StreamingResponse(events, headers=headers, media_type="text/event-stream")
