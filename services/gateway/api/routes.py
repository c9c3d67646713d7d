"""Public API routes: the caller is authenticated by `CallerDep`; the service admits and forwards."""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway.api.deps import CallerDep, ServiceDep

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Create a chat completion (OpenAI-compatible; `stream: true` for server-sent events)."""
    return await service.completion(request, caller)


@router.post("/v1/completions")
async def completions(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Create a text completion (OpenAI-compatible; `stream: true` for server-sent events)."""
    return await service.completion(request, caller)


@router.get("/v1/models")
async def list_models(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """List the models that live workers serve."""
    return await service.call(request, caller)
