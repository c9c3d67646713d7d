"""OpenAI's Conversations API (`/v1/conversations`) on the caller's tenant's sessions: a
conversation is a session and its items are the session's messages
(`services/sessions/conversations/protocol.py`). Another tenant's conversation gets 404."""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from services.sessions.conversations.protocol import (
    MAX_SEQ,
    conversation_not_found,
    conversation_public,
    item_list,
    item_not_found,
    item_position,
    items_to_messages,
    message_items,
    session_id_of,
)
from services.sessions.deps import CallerDep, services_of
from services.sessions.history import SessionInfo, SessionStore, StoredMessage
from shared.conversation_requests import ConversationCreate, ConversationItemsCreate, ConversationUpdate
from shared.errors import InvalidRequest, NotFound
from shared.logging import bind_contextvars
from shared.schemas import Message


async def _bind_conversation_id(request: Request) -> None:
    """Put the conversation id on every log line of the request."""
    if conversation := request.path_params.get("conversation_id"):
        bind_contextvars(conversation_id=conversation)


router = APIRouter(prefix="/v1/conversations", dependencies=[Depends(_bind_conversation_id)])


def _store(request: Request) -> SessionStore:
    return services_of(request.scope).sessions


async def _conversation(store: SessionStore, tenant: str, conversation: str) -> SessionInfo:
    """The tenant's session behind `conversation`.

    Raises:
        NotFound: no such conversation, or another tenant's.
    """
    try:
        return await store.get(tenant, session_id_of(conversation))
    except NotFound:
        raise conversation_not_found() from None


async def _append(store: SessionStore, info: SessionInfo, messages: list[Message]) -> list[dict[str, Any]]:
    """Store `messages` in order; their items."""
    stored = [await store.append(info, message, status="complete", job_id=None) for message in messages]
    return [item for message in stored for _, item in message_items(message)]


async def _find(store: SessionStore, info: SessionInfo, item_id: str) -> tuple[StoredMessage, int, dict[str, Any]]:
    """The message holding item `item_id`, the item's part and the item.

    Raises:
        NotFound: no such item (or it was deleted).
    """
    position = item_position(item_id)
    if position is not None:
        seq, part = position
        found = await store.messages(info, start_seq=seq, descending=False, limit=1)
        if found and found[0].seq == seq:
            for index, item in message_items(found[0]):
                if index == part and item["id"] == item_id:
                    return found[0], part, item
    raise item_not_found()


@router.post("")
async def create_conversation(body: ConversationCreate, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Create a conversation (a session), with up to 20 initial items and metadata."""
    messages = items_to_messages(body.items or [])  # checked before anything is stored
    store = _store(request)
    info = await store.create(caller.tenant, title=None, system_prompt=None, model=None, metadata=body.metadata)
    await _append(store, info, messages)
    return conversation_public(info)


@router.get("/{conversation_id}")
async def get_conversation(conversation_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Get one conversation."""
    return conversation_public(await _conversation(_store(request), caller.tenant, conversation_id))


@router.post("/{conversation_id}")
async def update_conversation(
    conversation_id: str, body: ConversationUpdate, caller: CallerDep, request: Request
) -> dict[str, Any]:
    """Replace a conversation's metadata."""
    store = _store(request)
    info = await _conversation(store, caller.tenant, conversation_id)
    try:
        updated = await store.set_metadata(caller.tenant, info.id, body.metadata or {})
    except NotFound:
        raise conversation_not_found() from None
    return conversation_public(updated)


@router.delete("/{conversation_id}")
async def delete_conversation(conversation_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Delete a conversation (its session) and all its items."""
    store = _store(request)
    info = await _conversation(store, caller.tenant, conversation_id)
    try:
        await store.delete(caller.tenant, info.id)
    except NotFound:
        raise conversation_not_found() from None
    return {"id": conversation_public(info)["id"], "object": "conversation.deleted", "deleted": True}


@router.get("/{conversation_id}/items")
async def list_items(
    conversation_id: str,
    caller: CallerDep,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    after: Annotated[str | None, Query(max_length=64, description="id of the last item of the previous page")] = None,
) -> dict[str, Any]:
    """List a conversation's items, newest first unless `order=asc`."""
    store = _store(request)
    info = await _conversation(store, caller.tenant, conversation_id)
    cursor = None
    if after is not None and (cursor := item_position(after)) is None:
        raise InvalidRequest("after: not an item id.", param="after", code="invalid_value")
    descending = order == "desc"
    start = cursor[0] if cursor else (MAX_SEQ if descending else 0)
    items: list[dict[str, Any]] = []
    batch = limit + 1
    while True:
        messages = await store.messages(info, start_seq=start, descending=descending, limit=batch)
        for message in messages:
            parts = message_items(message)
            for part, item in reversed(parts) if descending else parts:
                position = (message.seq, part)
                if cursor is None or (position < cursor if descending else position > cursor):
                    items.append(item)
        if len(items) > limit or len(messages) < batch:
            break
        start = messages[-1].seq + (-1 if descending else 1)
    return item_list(items[:limit], has_more=len(items) > limit)


@router.post("/{conversation_id}/items")
async def create_items(
    conversation_id: str, body: ConversationItemsCreate, caller: CallerDep, request: Request
) -> dict[str, Any]:
    """Append up to 20 items to a conversation; the items created."""
    messages = items_to_messages(body.items)
    store = _store(request)
    info = await _conversation(store, caller.tenant, conversation_id)
    return item_list(await _append(store, info, messages), has_more=False)


@router.get("/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Get one item of a conversation."""
    store = _store(request)
    info = await _conversation(store, caller.tenant, conversation_id)
    _, _, item = await _find(store, info, item_id)
    return item


@router.delete("/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, caller: CallerDep, request: Request) -> dict[str, Any]:
    """Delete one item of a conversation; the conversation."""
    store = _store(request)
    info = await _conversation(store, caller.tenant, conversation_id)
    message, part, _ = await _find(store, info, item_id)
    await store.delete_item(info, seq=message.seq, part=part)
    return conversation_public(info)
