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


@router.post("/v1/sessions", status_code=201)
async def create_session(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Create a session (optional `title`, `system_prompt`, `model`)."""
    return await service.call(request, caller)


@router.get("/v1/sessions")
async def list_sessions(request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """List your sessions, newest first (`limit`, `after`)."""
    return await service.call(request, caller)


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Get one of your sessions."""
    return await service.call(request, caller)


@router.patch("/v1/sessions/{session_id}")
async def update_session(session_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Rename one of your sessions (`title`)."""
    return await service.call(request, caller)


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """Delete one of your sessions and all its messages."""
    return await service.call(request, caller)


@router.get("/v1/sessions/{session_id}/messages")
async def list_session_messages(session_id: str, request: Request, caller: CallerDep, service: ServiceDep) -> Response:
    """List a session's messages, oldest first (`limit`, `after`)."""
    return await service.call(request, caller)
