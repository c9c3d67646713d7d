"""Public API routes: authenticate (via `CallerDep`), check the body, forward to the session manager."""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway.api.deps import Caller, CallerDep, ForwarderDep
from services.gateway.service import read_json_body

router = APIRouter()


def _upstream_headers(request: Request, caller: Caller) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "x-request-id": request.scope["state"]["request_id"],
        "x-axon-tenant": caller.tenant,
        "x-axon-priority": str(caller.priority),
    }


async def _forward_body(request: Request, caller: Caller, forwarder: ForwarderDep) -> Response:
    body = await read_json_body(request, max_bytes=request.app.state.settings.max_body_bytes)
    return await forwarder.forward(
        "POST", request.url.path, body=body, headers=_upstream_headers(request, caller)
    )


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, caller: CallerDep, forwarder: ForwarderDep) -> Response:
    """Create a chat completion (OpenAI-compatible; `stream: true` for server-sent events)."""
    return await _forward_body(request, caller, forwarder)


@router.post("/v1/completions")
async def completions(request: Request, caller: CallerDep, forwarder: ForwarderDep) -> Response:
    """Create a text completion (OpenAI-compatible; `stream: true` for server-sent events)."""
    return await _forward_body(request, caller, forwarder)


@router.get("/v1/models")
async def list_models(request: Request, caller: CallerDep, forwarder: ForwarderDep) -> Response:
    """List the models that live workers serve."""
    return await forwarder.forward("GET", "/v1/models", body=None, headers=_upstream_headers(request, caller))
