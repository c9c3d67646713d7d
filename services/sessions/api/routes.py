"""HTTP routes of the session manager: they only translate between HTTP and the service."""

import asyncio
from collections.abc import Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from shared.errors import AxonError, ModelNotFound
from shared.logging import bind_contextvars
from shared.web import ClientGone, ORJSONResponse, unless_disconnected
from services.sessions.api.deps import CallerDep, RequestIdDep, ServiceDep
from services.sessions.protocol import ChatCompletionRequest, CompletionRequest, Kind

router = APIRouter()

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _complete(
    body: ChatCompletionRequest | CompletionRequest,
    *,
    kind: Kind,
    service: ServiceDep,
    caller: CallerDep,
    request_id: str,
    request: Request,
) -> Response:
    if isinstance(body, ChatCompletionRequest) and body.session_id is not None:
        bind_contextvars(session_id=body.session_id)
    active = await service.start(body, kind=kind, caller=caller, request_id=request_id)
    first, rest = await unless_disconnected(request, service.first_chunk(active))
    if body.stream:
        events = service.sse(active, first, rest, include_usage=body.include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers={**_SSE_HEADERS, **active.headers()})
    answer = await unless_disconnected(request, service.collect(active, first, rest))
    return ORJSONResponse(answer, headers=active.headers())


async def _counted(request: Request, model: str, answer: Awaitable[Response]) -> Response:
    """Await the answer and count it by route, model and status (`axon_sessions_completion_requests_total`).

    A model no worker has ever served is counted as `unknown`: label values must not come
    from arbitrary client input.
    """
    status = 500
    try:
        response = await answer
        status = response.status_code
        return response
    except AxonError as exc:
        status = exc.status_code
        model = "unknown" if isinstance(exc, ModelNotFound) else model
        raise
    except (ClientGone, asyncio.CancelledError):
        status = 499
        raise
    finally:
        route = request.scope["route"].path
        request.app.state.metrics.completion_requests.labels(route, model, str(status)).inc()


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, service: ServiceDep, caller: CallerDep, request_id: RequestIdDep, request: Request
) -> Response:
    """Create a chat completion (streamed as server-sent events when `stream` is true)."""
    answer = _complete(body, kind="chat", service=service, caller=caller, request_id=request_id, request=request)
    return await _counted(request, body.model, answer)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, service: ServiceDep, caller: CallerDep, request_id: RequestIdDep, request: Request
) -> Response:
    """Create a text completion (streamed as server-sent events when `stream` is true)."""
    answer = _complete(body, kind="completion", service=service, caller=caller, request_id=request_id, request=request)
    return await _counted(request, body.model, answer)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """List the models that at least one live worker serves, and their aliases."""
    models = await request.app.state.catalog.listing()
    return ORJSONResponse({"object": "list", "data": models})
