"""HTTP routes of the session manager: they only translate between HTTP and the service.

The completion routes, which every generated token takes, are plain ASGI handlers ahead of
FastAPI (`HOT_ROUTES`, installed with `shared.hot_routes.HotRoutes`); the rest are FastAPI routes.
"""

import asyncio

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from services.sessions.api.deps import CallerDep, caller_from
from services.sessions.service import Caller, CompletionService, sse_error
from services.sessions.stream_resume import open_chat_stream
from shared.disconnects import DisconnectWatch
from shared.errors import AxonError, ModelNotFound
from shared.hot_routes import HotRoute, read_body, send_json
from shared.logging import bind_contextvars
from shared.openai_requests import ChatCompletionRequest, CompletionRequest, Kind, RequestLimits, parse_request
from shared.responses import SSE_END, ORJSONResponse
from shared.url_params import ANY

router = APIRouter()

# The gateway forwards bodies of at most AXON_MAX_BODY_BYTES; this only bounds a bad internal caller.
MAX_BODY_BYTES = 64 * 1024 * 1024

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
# An SSE comment: clients ignore it, proxies see the connection is not idle.
SSE_KEEPALIVE = b": keep-alive\n\n"


class StreamKeepAlive:
    """Keeps a stream's connection busy while its request waits for a worker of its model to start
    (`CompletionService.first_chunk`'s `on_wait`): the first beat sends the head (200: any later
    failure is an error event), each beat an SSE comment."""

    __slots__ = ("_headers", "_send", "started")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self._send = send
        self._headers = headers
        self.started = False

    async def beat(self) -> None:
        if not self.started:
            await self._send({"type": "http.response.start", "status": 200, "headers": self._headers})
            self.started = True
        await self._send({"type": "http.response.body", "body": SSE_KEEPALIVE, "more_body": True})


def _hot_completion(kind: Kind) -> HotRoute:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        service: CompletionService = scope["app"].state.completions
        metrics = scope["app"].state.metrics
        caller = caller_from(scope)
        limits: RequestLimits = scope["app"].state.request_limits
        body = parse_request(kind, await read_body(scope, receive, max_bytes=MAX_BODY_BYTES), limits)
        status, model = 500, body.model
        try:
            status = await _complete(service, body, kind=kind, caller=caller, scope=scope, receive=receive, send=send)
        except AxonError as exc:
            status = exc.status_code
            model = "unknown" if isinstance(exc, ModelNotFound) else model
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away (or the process is stopping)
            raise
        finally:
            # Model label values come from clients: a model no worker ever served is `unknown`.
            metrics.completion_requests.labels(path, model, str(status)).inc()

    return HotRoute("POST", path, handler)


async def _complete(
    service: CompletionService,
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
    active = await service.start(body, kind=kind, caller=caller, request_id=scope["state"]["request_id"])
    watch = DisconnectWatch(scope, receive)
    try:
        extra = [(name.encode(), value.encode()) for name, value in active.headers().items()]
        keepalive = None
        if body.stream and active.job.start_by is not None:  # queued for a model with no live worker
            keepalive = StreamKeepAlive(send, _SSE_HEADERS + extra)
        try:
            first, rest = await service.first_chunk(active, on_wait=keepalive.beat if keepalive else None)
        except AxonError as exc:
            if keepalive is None or not keepalive.started:
                raise
            watch.stop()
            await send({"type": "http.response.body", "body": sse_error(exc), "more_body": False})
            return 200
        if not body.stream:
            answer = await service.collect(active, first, rest)
            watch.stop()
            await send_json(send, 200, orjson.dumps(answer), extra)
            return 200
        started = keepalive is not None and keepalive.started
        async for piece in service.sse(active, first, rest):
            if not started:  # the head goes out right before the first piece: the gateway reads them together
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + extra})
                started = True
            ended = piece.endswith(SSE_END)
            if ended:
                watch.stop()
            await send({"type": "http.response.body", "body": piece, "more_body": not ended})
        return 200
    finally:
        watch.stop()


HOT_ROUTES = [_hot_completion("chat"), _hot_completion("completion")]


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """List the models that at least one live worker serves, and their aliases."""
    models = await request.app.state.catalog.listing()
    return ORJSONResponse({"object": "list", "data": models})


@router.get(f"/v1/models/{{model_id:{ANY}}}")
async def get_model(model_id: str, request: Request) -> Response:
    """One live model (or alias): its context length and the parameters its workers honour."""
    return ORJSONResponse(await request.app.state.catalog.entry(model_id))


@router.get("/v1/chat/completions/{completion_id}/stream")
async def resume_chat_stream(
    completion_id: str, request: Request, caller: CallerDep, starting_after: str | None = None
) -> Response:
    """The rest of a session turn's streamed chat completion after the event `starting_after` (or
    the `Last-Event-ID` header; neither: from the start), live until it ends, from any replica."""
    events = await open_chat_stream(
        request.app.state.chunk_log,
        completion_id,
        tenant=caller.tenant,
        starting_after=starting_after,
        last_event_id=request.headers.get("last-event-id"),
    )
    headers = {name.decode(): value.decode() for name, value in _SSE_HEADERS if name != b"content-type"}
    return StreamingResponse(events, headers=headers, media_type="text/event-stream")
