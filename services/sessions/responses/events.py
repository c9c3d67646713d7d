"""OpenAI's Responses streaming events, built from a response's skeleton and its job's chunks, and
the helpers that replay them from a chunk log after a given `sequence_number`."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

from services.sessions.responses.protocol import output_id, skeleton_of
from shared.errors import AxonError, InvalidRequest
from shared.schemas import FunctionCall, Message, TokenChunk, ToolCall, Usage

# A text delta event's fixed bytes (`ResponseEvents._text_delta`: what `_event` makes of it).
_DELTA_HEAD = b"event: response.output_text.delta\nid: "
_DELTA_DATA = b'\ndata: {"type":"response.output_text.delta","sequence_number":'
_DELTA_TAIL = b',"logprobs":[]}\n\n'


class ResponseEvents:
    """OpenAI's Responses streaming events of one answer, numbered from 0 (`sequence_number`):
    `response.created` (`queued` for a background response) and `response.in_progress`; per
    output item, as the chunks bring it, `response.output_item.added` (then for a message
    `response.content_part.added` and `response.output_text.delta`s, for a call
    `response.function_call_arguments.delta`s); at the end, per item in order,
    `response.output_text.done` + `response.content_part.done` or
    `response.function_call_arguments.done`, then `response.output_item.done`; last
    `response.completed` or `response.incomplete`, or `response.failed` (a failed or cancelled
    response).

    The events are a function of the skeleton and the chunks (ids from the response id and the
    output index), so a replica that feeds it the same chunks from the job's log gets the same
    bytes. `quiet`: keep the answer's state without building the events' bytes (each is b"").
    """

    def __init__(self, skeleton: dict[str, Any], *, quiet: bool = False) -> None:
        self._skeleton = skeleton
        self._response_id: str = skeleton["id"]
        # Count events without building their bytes (each is b"").
        self.quiet = quiet
        # The number of events so far (the next one's sequence_number).
        self.seq = 0
        # The last chunk applied, its finish reason, usage and error message.
        self.last_seq = -1
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.error: str | None = None
        self._items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        self._message_index = 0
        # The message's delta events' bytes between the sequence number and the delta's JSON.
        self._delta_fields = b""
        self._text: list[str] = []
        # Tool call index -> its function_call item (arguments accumulated in it).
        self._calls: dict[int, dict[str, Any]] = {}
        self._call_index: dict[int, int] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        seq = self.seq
        self.seq += 1
        if self.quiet:
            return b""
        payload = orjson.dumps({"type": kind, "sequence_number": seq, **fields})
        return b"event: " + kind.encode() + b"\nid: " + str(seq).encode() + b"\ndata: " + payload + b"\n\n"

    def _text_delta(self, text: str) -> bytes:
        """`_event("response.output_text.delta", item_id=..., output_index=..., content_index=0,
        delta=text, logprobs=[])`, the same bytes, built from its fixed parts (the event of
        nearly every chunk)."""
        seq = self.seq
        self.seq += 1
        if self.quiet:
            return b""
        number = str(seq).encode()
        return b"".join((_DELTA_HEAD, number, _DELTA_DATA, number, self._delta_fields, orjson.dumps(text), _DELTA_TAIL))

    def opening(self) -> list[bytes]:
        created = {**self._skeleton, "status": "queued"} if self._skeleton.get("background") else self._skeleton
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=self._skeleton),
        ]

    def chunk(self, chunk: TokenChunk) -> list[bytes]:
        """The events of one chunk: its text's delta, its tool calls' pieces (none for a chunk
        already applied, or an error chunk)."""
        if chunk.seq <= self.last_seq:
            return []
        self.last_seq = chunk.seq
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.usage = chunk.usage
            if chunk.finish_reason == "error":
                self.error = chunk.error.message if chunk.error else "The worker failed to generate an answer."
                return []
        events: list[bytes] = []
        if chunk.text:
            if self._message is None:
                index = self._message_index = len(self._items)
                self._message = {
                    "id": output_id(self._response_id, "msg_", index),
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                }
                self._items.append(self._message)
                self._delta_fields = (
                    b',"item_id":"'
                    + self._message["id"].encode()
                    + b'","output_index":'
                    + str(index).encode()
                    + b',"content_index":0,"delta":'
                )
                events.append(
                    self._event("response.output_item.added", output_index=index, item={**self._message, "content": []})
                )
                events.append(
                    self._event(
                        "response.content_part.added",
                        item_id=self._message["id"],
                        output_index=index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    )
                )
            self._text.append(chunk.text)
            events.append(self._text_delta(chunk.text))
        for delta in chunk.tool_calls or ():
            call = self._calls.get(delta.index)
            if call is None:
                index = len(self._items)
                name = delta.function.name if delta.function is not None and delta.function.name else ""
                call = {
                    "id": output_id(self._response_id, "fc_", index),
                    "type": "function_call",
                    "call_id": delta.id or output_id(self._response_id, "call_", index),
                    "name": name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._calls[delta.index] = call
                self._call_index[delta.index] = index
                self._items.append(call)
                events.append(self._event("response.output_item.added", output_index=index, item=dict(call)))
            elif delta.function is not None and delta.function.name:
                call["name"] += delta.function.name
            if delta.function is not None and delta.function.arguments:
                call["arguments"] += delta.function.arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=call["id"],
                        output_index=self._call_index[delta.index],
                        delta=delta.function.arguments,
                    )
                )
        return events

    def output(self, status: str) -> list[dict[str, Any]]:
        """The output items so far, each with `status`."""
        items = []
        for item in self._items:
            if item is self._message:
                part = {"type": "output_text", "text": "".join(self._text), "annotations": [], "logprobs": []}
                items.append({**item, "status": status, "content": [part]})
            else:
                items.append({**item, "status": status})
        return items

    def reply(self) -> Message:
        """The answer so far as an assistant message (its text and tool calls)."""
        calls = [
            ToolCall(id=call["call_id"], function=FunctionCall(name=call["name"], arguments=call["arguments"]))
            for _, call in sorted(self._calls.items())
        ]
        return Message(role="assistant", content="".join(self._text), tool_calls=calls or None)

    def _items_done(self, output: list[dict[str, Any]]) -> list[bytes]:
        events: list[bytes] = []
        for index, item in enumerate(output):
            if item["type"] == "message":
                part = item["content"][0]
                events.append(
                    self._event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                        logprobs=[],
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                    )
                )
            else:
                events.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def closing(self, response: dict[str, Any]) -> list[bytes]:
        """The end of finished `response`: for a completed or incomplete one, every item's end,
        then `response.completed` or `response.incomplete`; for a failed or cancelled one,
        `response.failed` (OpenAI's events have no `response.cancelled`)."""
        status = response["status"]
        if status in ("failed", "cancelled"):
            return [self._event("response.failed", response=response)]
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*self._items_done(response["output"]), self._event(kind, response=response)]


def events_after(events: ResponseEvents, pieces: list[bytes], after: int) -> list[bytes]:
    """Those of `pieces`, the events `events` just made (numbered up to its `seq`), numbered past
    `after`."""
    first = events.seq - len(pieces)
    return pieces[max(0, after + 1 - first) :]


async def beating(pages: AsyncIterator[list[TokenChunk]], interval_s: float) -> AsyncIterator[list[TokenChunk] | None]:
    """`pages`, with None each time `interval_s` passes without one (the next page is awaited in
    a task, which a wait that ends does not cancel)."""
    next_page = asyncio.ensure_future(anext(pages))
    try:
        while True:
            done, _ = await asyncio.wait({next_page}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                page = next_page.result()
            except StopAsyncIteration:
                return
            yield page
            next_page = asyncio.ensure_future(anext(pages))
    finally:
        next_page.cancel()


def counted_events(response: dict[str, Any], chunks: list[TokenChunk]) -> ResponseEvents:
    """`response`'s events up to its closing ones, of logged `chunks`, counted (quiet)."""
    counted = ResponseEvents(skeleton_of(response), quiet=True)
    counted.opening()
    for chunk in chunks:
        counted.chunk(chunk)
    return counted


def past_the_end(after: int, count: int) -> InvalidRequest:
    return InvalidRequest(
        f"starting_after is {after}, past the end of this response (its last event is {count - 1}).",
        param="starting_after",
        code="invalid_value",
    )


def check_after(after: int, count: int) -> None:
    """Raise `past_the_end` if `after` is at or past the last of a response's `count` events."""
    if after >= count - 1:
        raise past_the_end(after, count)


def error_event(exc: AxonError, seq: int) -> bytes:
    """OpenAI's `error` streaming event of `exc` (no SSE id: a client resumes after the event it
    got before)."""
    payload = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": seq}
    return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


def most_events(chunk: TokenChunk) -> int:
    """The most events one chunk can make: a message's first text makes three, each tool call
    delta two."""
    return (3 if chunk.text else 0) + 2 * len(chunk.tool_calls or ())
