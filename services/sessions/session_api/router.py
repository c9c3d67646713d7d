"""Sessions API: conversations owned by the caller's tenant (another tenant gets 404)."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from services.sessions.deps import CallerDep, services_of
from services.sessions.history import SessionStore
from shared.logging import bind_contextvars
from shared.session_requests import SessionCreate, SessionUpdate


async def _bind_session_id(request: Request) -> None:
    """Put the session id on every log line of the request (an async dependency runs in its task)."""
    if session_id := request.path_params.get("session_id"):
        bind_contextvars(session_id=session_id)


router = APIRouter(prefix="/v1/sessions", dependencies=[Depends(_bind_session_id)])


def _store(request: Request) -> SessionStore:
    return services_of(request.scope).sessions


@router.post("", status_code=201)
async def create_session(body: SessionCreate, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Create a session (optional title, system prompt and model)."""
    info = await _store(request).create(
        caller.tenant, title=body.title, system_prompt=body.system_prompt, model=body.model
    )
    return info.public()


@router.get("")
async def list_sessions(
    caller: CallerDep,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[
        str | None, Query(max_length=64, description="id of the last session of the previous page")
    ] = None,
) -> dict[str, Any]:
    """List the caller's sessions, newest first."""
    items, has_more = await _store(request).list_sessions(caller.tenant, limit=limit, after=after)
    return {"object": "list", "data": [i.public() for i in items], "has_more": has_more}


@router.get("/{session_id}")
async def get_session(session_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Get one session."""
    return (await _store(request).get(caller.tenant, session_id)).public()


@router.patch("/{session_id}")
async def update_session(session_id: str, body: SessionUpdate, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Rename a session."""
    return (await _store(request).rename(caller.tenant, session_id, title=body.title)).public()


@router.delete("/{session_id}")
async def delete_session(session_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Delete a session and all its messages."""
    await _store(request).delete(caller.tenant, session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.get("/{session_id}/messages")
async def list_messages(
    session_id: str,
    caller: CallerDep,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    after: Annotated[int, Query(ge=0, description="seq of the last message of the previous page")] = 0,
) -> dict[str, Any]:
    """List a session's messages, oldest first."""
    store = _store(request)
    info = await store.get(caller.tenant, session_id)
    items, has_more = await store.page(info, after_seq=after, limit=limit)
    return {"object": "list", "data": [m.public() for m in items], "has_more": has_more}
