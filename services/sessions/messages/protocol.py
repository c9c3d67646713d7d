"""Anthropic's response objects for `POST /v1/messages`: a finished chat answer as a `Message`
(`message_object`), and its chunks as Anthropic's stream events (`MessageEvents`).

A Message's `content` is the answer's text as a `text` block, then each tool call as a `tool_use`
block (`input`: its arguments parsed; an id `toolu_...`); `stop_reason` is `end_turn`,
`max_tokens`, `stop_sequence` (with the `stop_sequence` that matched) or `tool_use`; `usage` says
`input_tokens` (the prompt's tokens the engine did not read from its cache),
`cache_read_input_tokens` (those it did, where it reports them) and `output_tokens`.

A stream is `message_start`, `ping`, then for each content block `content_block_start`, its
`content_block_delta`s (`text_delta`, or `input_json_delta` with pieces of a tool call's
arguments), `content_block_stop`, and at the end `message_delta` (stop reason, usage) and
`message_stop`; a failure after the head went out is an `error` event, which also ends it.
Events carry no SSE `id:` (Anthropic's have none).
"""

from collections.abc import Sequence
from typing import Any, Final

import orjson

from services.sessions.chat.protocol import Answer
from shared.anthropic_errors import anthropic_error
from shared.errors import AxonError
from shared.messages_requests import TOOL_USE_PREFIX
from shared.schemas import FinishReason, ToolCall, ToolCallDelta, Usage

MESSAGE_PREFIX: Final = "msg_"
# How a chat answer's tool call ids start (the workers'), replaced by Anthropic's prefix.
_CALL_PREFIX: Final = "call_"


def message_id(job_id: str) -> str:
    """The Message's id for the job that answers it (`msg_` and the job id's hex digits)."""
    return MESSAGE_PREFIX + job_id.replace("-", "")


def tool_use_id(call_id: str) -> str:
    """A tool call's id as a `tool_use` block's (`toolu_...`)."""
    return TOOL_USE_PREFIX + call_id.removeprefix(_CALL_PREFIX)


def stop_reason(reason: FinishReason | None, *, tool_calls: bool, stop_sequence: str | None) -> str:
    """Anthropic's `stop_reason` for a chat answer that ended with `reason`: `max_tokens` at its
    length (a tool call cut there too), `tool_use` if it made tool calls (a call forced by name
    ends `stop`), `stop_sequence` when one matched, else `end_turn` (a cancelled answer simply
    ended)."""
    if reason == "length":
        return "max_tokens"
    if tool_calls or reason == "tool_calls":
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def message_usage(usage: Usage | None) -> dict[str, Any]:
    """Anthropic's `usage`: input tokens not read from the cache, those read from it (null where
    the engine does not say), output tokens."""
    usage = usage or Usage()
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    return {
        "input_tokens": usage.prompt_tokens - (cached or 0),
        "cache_creation_input_tokens": 0 if cached is not None else None,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.completion_tokens,
    }


def _arguments(text: str) -> dict[str, Any]:
    """A tool call's arguments as `input` (an object; arguments that are not one are kept whole
    under `arguments`, rather than lost)."""
    try:
        parsed = orjson.loads(text or "{}")
    except orjson.JSONDecodeError:
        return {"arguments": text}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": tool_use_id(call.id),
        "name": call.function.name,
        "input": _arguments(call.function.arguments),
    }


def message_object(
    *,
    job_id: str,
    model: str,
    answer: Answer,
    usage: Usage | None,
    stop_sequence: str | None = None,
) -> dict[str, Any]:
    """The whole `Message` for a finished chat `answer` (its choice's), with the request's `usage`.

    Args:
        job_id: the answer's job (the Message's id follows from it).
        model: the model as the request named it.
        stop_sequence: the stop sequence that ended the answer, if one did.
    """
    calls = answer.tool_calls or []
    content: list[dict[str, Any]] = []
    text = answer.content
    if text or not calls:
        content.append({"type": "text", "text": text})
    content.extend(tool_use_block(call) for call in calls)
    return {
        "id": message_id(job_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(answer.finish_reason, tool_calls=bool(calls), stop_sequence=stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": message_usage(usage),
    }


def sse(event: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event of Anthropic's stream (`event:` its type, `data:` its JSON)."""
    return b"event: %b\ndata: %b\n\n" % (event.encode(), orjson.dumps(payload))


PING: Final = sse("ping", {"type": "ping"})


def error_event(exc: AxonError) -> bytes:
    """The `error` event that ends a stream whose head went out."""
    _, body, _ = anthropic_error(exc)
    return sse("error", body)


class MessageEvents:
    """Anthropic's stream events for one answer, as its chunks arrive: `opening` once, `chunk` for
    each, `closing` at its end. Content blocks are numbered in the order they open: the text
    (if the answer starts with text), then one per tool call (by its delta's `index`)."""

    __slots__ = ("_block", "_blocks", "_calls", "_open", "job_id", "model")

    def __init__(self, *, job_id: str, model: str) -> None:
        self.job_id = job_id
        self.model = model
        # The number of blocks opened so far, and the open one's index (None: none open).
        self._blocks = 0
        self._open: int | None = None
        # The open block's kind: "text", or the tool call index it holds.
        self._block: str | int | None = None
        self._calls: set[int] = set()

    def opening(self, usage: Usage | None = None) -> list[bytes]:
        """`message_start` (the Message with no content yet) and a `ping`."""
        message: dict[str, Any] = {
            "id": message_id(self.job_id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**message_usage(usage), "output_tokens": 0},
        }
        return [sse("message_start", {"type": "message_start", "message": message}), PING]

    def chunk(self, text: str, tool_calls: Sequence[ToolCallDelta] | None) -> list[bytes]:
        """The events of one chunk's `text` and tool-call deltas."""
        events: list[bytes] = []
        if text:
            if self._block != "text":
                events += self._start({"type": "text", "text": ""}, "text")
            events.append(self._delta({"type": "text_delta", "text": text}))
        for delta in tool_calls or ():
            if delta.index not in self._calls:
                self._calls.add(delta.index)
                name = delta.function.name if delta.function is not None else None
                block = {"type": "tool_use", "id": tool_use_id(delta.id or ""), "name": name or "", "input": {}}
                events += self._start(block, delta.index)
            elif self._block != delta.index:
                continue  # a late piece of a call whose block was closed: no block reopens
            arguments = delta.function.arguments if delta.function is not None else None
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def closing(self, *, reason: FinishReason | None, usage: Usage | None, stop_sequence: str | None) -> list[bytes]:
        """`content_block_stop` of the open block, `message_delta` (stop reason, usage) and `message_stop`."""
        events = self._stop()
        usage_body = message_usage(usage)
        delta = {
            "stop_reason": stop_reason(reason, tool_calls=bool(self._calls), stop_sequence=stop_sequence),
            "stop_sequence": stop_sequence,
        }
        events.append(sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_body}))
        events.append(sse("message_stop", {"type": "message_stop"}))
        return events

    def _start(self, block: dict[str, Any], kind: str | int) -> list[bytes]:
        events = self._stop()
        self._open, self._block = self._blocks, kind
        self._blocks += 1
        start = {"type": "content_block_start", "index": self._open, "content_block": block}
        return [*events, sse("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self._open, "delta": delta})

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open, self._block = self._open, None, None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": index})]
