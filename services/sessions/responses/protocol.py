"""OpenAI's Responses objects: the Response object, its input and output items, and the messages
they stand for (a response runs as a chat completion on those messages)."""

import time
import uuid
from typing import Any

from services.sessions.chat.protocol import Answer
from services.sessions.conversations.protocol import (
    items_to_messages,
)
from shared.errors import NotFound
from shared.responses_requests import ResponseCreate
from shared.schemas import Message, Usage

RESPONSE_PREFIX = "resp_"
# A finished response's status; before it is `queued` (background, no chunk yet) or `in_progress`.
FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})
# The status a job's finish reason gives (any other: `completed`).
_STATUS_OF = {"length": "incomplete", "cancelled": "cancelled", "error": "failed"}
# The error of a response whose job no worker took before its deadline.


def response_not_found() -> NotFound:
    return NotFound("No such response.", param="response_id", code="response_not_found")


def previous_not_found() -> NotFound:
    return NotFound("No such response.", param="previous_response_id", code="previous_response_not_found")


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def output_id(response_id: str, prefix: str, index: int) -> str:
    """The id of output item `index` of a response (`msg_<response hex>_<index>`): the same on
    every replica that rebuilds the response from its chunks."""
    return f"{prefix}{response_id.removeprefix(RESPONSE_PREFIX)}_{index}"


def status_of(finish_reason: str | None) -> str:
    """A finished response's status by its job's finish reason."""
    return _STATUS_OF.get(finish_reason or "stop", "completed")


def input_messages(body: ResponseCreate) -> list[Message]:
    """`input` as session messages (a string is one user message).

    Raises:
        InvalidRequest: an item of a type Axon does not take, or a malformed one (`input[0].type`).
    """
    if isinstance(body.input, str):
        return [Message(role="user", content=body.input)]
    return items_to_messages(body.input, param="input")


def message_items(messages: list[Message], *, status: str = "completed") -> list[dict[str, Any]]:
    """OpenAI items of `messages`, each with an id of its own: a message (input_text, or
    output_text for an assistant's), an assistant's tool calls as function_call items, a tool's
    result as a function_call_output."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            items.append(
                {
                    "id": new_id("fco_"),
                    "type": "function_call_output",
                    "call_id": message.tool_call_id or "",
                    "output": message.content,
                    "status": status,
                }
            )
            continue
        if message.content or not message.tool_calls:
            assistant = message.role == "assistant"
            part: dict[str, Any] = (
                {"type": "output_text", "text": message.content, "annotations": [], "logprobs": []}
                if assistant
                else {"type": "input_text", "text": message.content}
            )
            items.append(
                {"id": new_id("msg_"), "type": "message", "role": message.role, "status": status, "content": [part]}
            )
        items.extend(
            {
                "id": new_id("fc_"),
                "type": "function_call",
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": status,
            }
            for call in message.tool_calls or ()
        )
    return items


def answer_message(answer: Answer) -> Message:
    return Message(role="assistant", content=answer.content, tool_calls=answer.tool_calls)


def usage_object(usage: Usage | None) -> dict[str, Any]:
    """OpenAI's ResponseUsage of a chat completion's usage."""
    usage = usage or Usage()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_object(
    body: ResponseCreate,
    *,
    response_id: str,
    created_at: float,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    conversation: str | None,
) -> dict[str, Any]:
    """OpenAI's Response object (`output_text` is left to the SDK, which computes it)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(created_at),
        "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": body.model,
        "output": output,
        "usage": usage_object(usage) if usage is not None or status in FINISHED else None,
        "conversation": {"id": conversation} if conversation is not None else None,
        **body.echo(),
    }


def finished_response(
    initial: dict[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The Response object `initial` (as created) once finished with `status`."""
    return {
        **initial,
        "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output,
        "usage": usage_object(usage),
    }


def skeleton_of(response: dict[str, Any]) -> dict[str, Any]:
    """The Response object a stream's first events carry (`in_progress`, no output), the same
    for any state of `response`: a replay's first events equal the original's."""
    return {
        **response,
        "status": "in_progress",
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "output": [],
        "usage": None,
    }
