"""HTTP routes of the session manager: they only translate between HTTP and the service."""

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from shared.web import ORJSONResponse
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
) -> Response:
    active = await service.start(body, kind=kind, caller=caller, request_id=request_id)
    first, rest = await service.first_chunk(active)
    if body.stream:
        events = service.sse(active, first, rest, include_usage=body.include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers={**_SSE_HEADERS, **active.headers()})
    return ORJSONResponse(await service.collect(active, first, rest), headers=active.headers())


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, service: ServiceDep, caller: CallerDep, request_id: RequestIdDep
) -> Response:
    """Create a chat completion (streamed as server-sent events when `stream` is true)."""
    return await _complete(body, kind="chat", service=service, caller=caller, request_id=request_id)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, service: ServiceDep, caller: CallerDep, request_id: RequestIdDep
) -> Response:
    """Create a text completion (streamed as server-sent events when `stream` is true)."""
    return await _complete(body, kind="completion", service=service, caller=caller, request_id=request_id)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """List the models that at least one live worker serves, and their aliases."""
    models = await request.app.state.catalog.listing()
    return ORJSONResponse({"object": "list", "data": models})
