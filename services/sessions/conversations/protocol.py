"""OpenAI's Conversations API on Axon's sessions: ids, and items <-> session messages.

A conversation IS a session (one store, one tenancy): its id is `conv_` + the session's UUID as
32 hex digits, and the routes take the session id itself too. Its items are the session's
messages, each one or more items:

- `user`, `system`, `developer`: part 0, `msg_<seq>`, a `message` with one `input_text` part;
- `assistant`: part 0, `msg_<seq>`, a `message` with one `output_text` part (none when the answer
  is only tool calls), and part i + 1, `fc_<seq>_<i + 1>`, a `function_call` for tool call i;
- `tool`: part 0, `fco_<seq>`, a `function_call_output` of its `tool_call_id`.

So an item's id is fixed by its message's `seq` and its part, and the items of a conversation are
ordered by (seq, part). Items created through the API become messages the same way back: a
`message` item is a message of its role (its text parts joined), an assistant `message` followed
by `function_call` items (or `function_call` items alone) is one assistant message with those tool
calls, as a chat answer is stored, and a `function_call_output` is a `tool` message. A deleted
item is a part of its message marked deleted (`StoredMessage.deleted`), which prompts no longer
contain.
"""

import re
import uuid
from typing import Any

from services.sessions.history import SessionInfo, StoredMessage
from shared.errors import InvalidRequest, NotFound
from shared.schemas import FunctionCall, Message, Role, ToolCall

CONVERSATION_PREFIX = "conv_"
# The largest `messages.seq` (a PostgreSQL integer).
MAX_SEQ = 2**31 - 1
_ITEM_ID = re.compile(r"(?:(msg|fco)_([0-9]{1,10})|fc_([0-9]{1,10})_([0-9]{1,6}))")
# A message's stored status as an item's.
_ITEM_STATUS = {"complete": "completed", "cancelled": "incomplete", "failed": "incomplete"}
_MESSAGE_ROLES: dict[str, Role] = {role: role for role in ("user", "system", "developer", "assistant")}
_TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output")


def conversation_not_found() -> NotFound:
    return NotFound("No such conversation.", param="conversation_id", code="conversation_not_found")


def item_not_found() -> NotFound:
    return NotFound("No such item in this conversation.", param="item_id", code="item_not_found")


def conversation_id(session_id: str) -> str:
    """The conversation id of a session."""
    return CONVERSATION_PREFIX + uuid.UUID(session_id).hex


def session_id_of(conversation: str) -> str:
    """The session id of a conversation id (`conv_<32 hex>`, or the session's own id).

    Raises:
        NotFound: neither form: no such conversation can exist.
    """
    raw = conversation.removeprefix(CONVERSATION_PREFIX)
    try:
        return str(uuid.UUID(raw))
    except ValueError:
        raise conversation_not_found() from None


def conversation_public(info: SessionInfo) -> dict[str, Any]:
    """OpenAI's Conversation object of a session."""
    return {
        "id": conversation_id(info.id),
        "object": "conversation",
        "created_at": int(info.created_at.timestamp()),
        "metadata": info.metadata,
    }


def item_position(item_id: str) -> tuple[int, int] | None:
    """(seq, part) of an item id, None if it is not one."""
    match = _ITEM_ID.fullmatch(item_id)
    if match is None:
        return None
    seq, part = (int(match[2]), 0) if match[2] is not None else (int(match[3]), int(match[4]))
    return (seq, part) if seq <= MAX_SEQ else None


def message_items(message: StoredMessage) -> list[tuple[int, dict[str, Any]]]:
    """A stored message's items that are not deleted, as (part, OpenAI item), in part order."""
    deleted = set(message.deleted or ())
    status = _ITEM_STATUS.get(message.status, "completed")
    items: list[tuple[int, dict[str, Any]]] = []
    if message.role == "tool":
        if 0 not in deleted:
            output: dict[str, Any] = {
                "id": f"fco_{message.seq}",
                "type": "function_call_output",
                "call_id": message.tool_call_id or "",
                "output": message.content,
                "status": status,
            }
            if message.name is not None:
                output["name"] = message.name
            items.append((0, output))
        return items
    if 0 not in deleted and (message.content or not message.tool_calls):
        assistant = message.role == "assistant"
        part: dict[str, Any] = {"type": "output_text", "text": message.content, "annotations": []}
        if not assistant:
            part = {"type": "input_text", "text": message.content}
        text = {"id": f"msg_{message.seq}", "type": "message", "role": message.role, "status": status}
        items.append((0, {**text, "content": [part]}))
    for index, call in enumerate(message.tool_calls or (), start=1):
        if index not in deleted:
            items.append(
                (
                    index,
                    {
                        "id": f"fc_{message.seq}_{index}",
                        "type": "function_call",
                        "call_id": call.id,
                        "name": call.function.name,
                        "arguments": call.function.arguments,
                        "status": status,
                    },
                )
            )
    return items


def _invalid(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param, code="invalid_value")


def _string(item: dict[str, Any], field: str, param: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise _invalid("a string is required.", f"{param}.{field}")
    return value


def _call_id(item: dict[str, Any], param: str) -> str:
    """The `call_id` of a function call or output: what pairs them, so never empty."""
    value = _string(item, "call_id", param)
    if not value:
        raise _invalid("a call_id cannot be empty.", f"{param}.call_id")
    return value


def _text(content: Any, param: str) -> str:
    """A message's (or a tool output's) text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid("a string or an array of content parts is required.", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _invalid("a content part must be an object.", where)
        if part.get("type") not in _TEXT_PARTS:
            raise _invalid(
                f"unsupported content part type {part.get('type')!r}; supported: 'input_text', 'output_text'.",
                f"{where}.type",
            )
        texts.append(_string(part, "text", where))
    return "".join(texts)


def items_to_messages(items: list[dict[str, Any]], *, param: str = "items") -> list[Message]:
    """The session messages that store `items` (OpenAI input items), in order.

    Raises:
        InvalidRequest: an item of a type Axon does not store, or a malformed one (`param` names
            it, e.g. `items[0].type`).
    """
    messages: list[Message] = []
    # The assistant message that `function_call` items right after it join.
    answer: Message | None = None
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role_name = item.get("role")
            role = _MESSAGE_ROLES.get(role_name) if isinstance(role_name, str) else None
            if role is None:
                raise _invalid("role must be one of 'user', 'assistant', 'system', 'developer'.", f"{where}.role")
            message = Message(role=role, content=_text(item.get("content"), f"{where}.content"))
            answer = message if role == "assistant" else None
            messages.append(message)
        elif kind == "function_call":
            call = ToolCall(
                id=_call_id(item, where),
                function=FunctionCall(name=_string(item, "name", where), arguments=_string(item, "arguments", where)),
            )
            if answer is None:
                answer = Message(role="assistant", content="")
                messages.append(answer)
            answer.tool_calls = [*(answer.tool_calls or ()), call]
        elif kind == "function_call_output":
            output = item.get("output")
            content = _text(output, f"{where}.output")
            messages.append(Message(role="tool", content=content, tool_call_id=_call_id(item, where)))
            answer = None
        else:
            supported = ", ".join(repr(t) for t in ITEM_TYPES)
            raise _invalid(f"unsupported item type {kind!r}; supported: {supported}.", f"{where}.type")
    return messages


def item_list(items: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """OpenAI's ConversationItemList."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else "",
        "last_id": items[-1]["id"] if items else "",
        "has_more": has_more,
    }
