"""services/sessions/messages/protocol.py: a chat answer as Anthropic's Message and stream events,
read back by the `anthropic` SDK's own models (its stream helpers: tests/e2e/test_messages.py)."""

from typing import Any

import orjson
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from services.sessions.chat.protocol import Answer
from services.sessions.messages.protocol import MessageEvents, error_event, message_object
from shared.errors import Unavailable
from shared.schemas import FunctionCallDelta, PromptTokensDetails, ToolCallDelta, Usage

USAGE = Usage(prompt_tokens=30, completion_tokens=7, prompt_tokens_details=PromptTokensDetails(cached_tokens=16))
EVENT = TypeAdapter(RawMessageStreamEvent)


def _answer(text: str, *, reason: str, calls: list[ToolCallDelta] | None = None) -> Answer:
    answer = Answer(0)
    answer.text.append(text)
    if calls:
        answer.add_tool_calls(calls)
    answer.finish_reason = reason  # type: ignore[assignment]
    return answer


def _call(index: int, name: str, *pieces: str) -> list[ToolCallDelta]:
    first = ToolCallDelta(index=index, id=f"call_{index}", type="function", function=FunctionCallDelta(name=name))
    return [first, *(ToolCallDelta(index=index, function=FunctionCallDelta(arguments=p)) for p in pieces)]


def test_a_text_answer_with_cached_input() -> None:
    body = message_object(job_id="1234-abcd", model="m", answer=_answer("Hello.", reason="stop"), usage=USAGE)
    message = Message.model_validate(body)
    assert message.id == "msg_1234abcd" and message.stop_reason == "end_turn" and message.stop_sequence is None
    assert [(b.type, b.text) for b in message.content if b.type == "text"] == [("text", "Hello.")]
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == (
        14,
        16,
        7,
    )


def test_stop_reasons() -> None:
    def reason(answer: Answer, stop: str | None = None) -> str:
        return message_object(job_id="j", model="m", answer=answer, usage=None, stop_sequence=stop)["stop_reason"]

    assert reason(_answer("a", reason="length")) == "max_tokens"
    assert reason(_answer("a", reason="stop"), "END") == "stop_sequence"
    assert reason(_answer("a", reason="cancelled")) == "end_turn"
    # A call forced by name ends `stop`: still tool_use.
    assert reason(_answer("", reason="stop", calls=_call(0, "f", '{"a":1}'))) == "tool_use"
    assert reason(_answer("", reason="length", calls=_call(0, "f", '{"a":'))) == "max_tokens"


def test_tool_calls_are_tool_use_blocks_after_the_text() -> None:
    calls = [*_call(0, "get_weather", '{"city":', '"Paris"}'), *_call(1, "get_time", "")]
    body = message_object(
        job_id="j", model="m", answer=_answer("Checking.", reason="tool_calls", calls=calls), usage=None
    )
    message = Message.model_validate(body)
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    weather, time = message.content[1], message.content[2]
    assert weather.type == "tool_use" and weather.id == "toolu_0" and weather.input == {"city": "Paris"}
    assert time.type == "tool_use" and time.input == {}
    assert message.stop_reason == "tool_use" and message.usage.cache_read_input_tokens is None


def _events(pieces: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for event in b"".join(pieces).split(b"\n\n")[:-1]:
        name, data = event.split(b"\n")
        payload = orjson.loads(data.removeprefix(b"data: "))
        assert name == b"event: " + payload["type"].encode()
        out.append(payload)
    return out


def test_a_stream_of_text_then_tool_calls_accumulates_to_the_whole_message() -> None:
    events = MessageEvents(job_id="j", model="m")
    pieces = events.opening()
    pieces += events.chunk("Let me ", None)
    pieces += events.chunk("check.", _call(0, "get_weather", '{"city":')[:1])
    pieces += events.chunk("", [ToolCallDelta(index=0, function=FunctionCallDelta(arguments='{"city":"Oslo"}'))])
    pieces += events.chunk("", _call(1, "get_time", "{}"))
    pieces += events.closing(reason="tool_calls", usage=USAGE, stop_sequence=None)
    payloads = _events(pieces)
    assert [p["type"] for p in payloads] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for payload in payloads[:1] + payloads[2:]:
        EVENT.validate_python(payload)  # each is one of the SDK's event types
    blocks = [p["content_block"] for p in payloads if p["type"] == "content_block_start"]
    assert [(b["type"], b.get("name")) for b in blocks] == [
        ("text", None),
        ("tool_use", "get_weather"),
        ("tool_use", "get_time"),
    ]
    assert [b["id"] for b in blocks[1:]] == ["toolu_0", "toolu_1"]
    deltas: dict[int, list[str]] = {}
    for p in payloads:
        if p["type"] == "content_block_delta":
            deltas.setdefault(p["index"], []).append(p["delta"].get("text") or p["delta"].get("partial_json"))
    assert {i: "".join(d) for i, d in deltas.items()} == {0: "Let me check.", 1: '{"city":"Oslo"}', 2: "{}"}
    end = payloads[-2]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    usage = end["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"], usage["output_tokens"]) == (14, 16, 7)


def test_a_stop_sequence_and_an_error_event() -> None:
    events = MessageEvents(job_id="j", model="m")
    closing = _events(events.closing(reason="stop", usage=None, stop_sequence="END"))
    assert closing[0]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    (error,) = _events([error_event(Unavailable("busy", code="queue_full"))])
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
