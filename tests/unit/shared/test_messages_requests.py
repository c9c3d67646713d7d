"""shared/messages_requests.py: a Messages body as the chat completion it runs as, and its 400s in
Anthropic's words naming the field; the document's schema agrees with the code on each body."""

import json
from typing import Any

import jsonschema_rs
import orjson
import pytest

from shared.errors import InvalidRequest
from shared.messages_requests import (
    CountTokensRequest,
    MessageCreate,
    as_messages_error,
    parse_count_tokens,
    parse_message_create,
)
from shared.openai_requests import RequestLimits

LIMITS = RequestLimits()
USER = {"role": "user", "content": "hi"}
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [USER], **fields}


def chat(fields: dict[str, Any]) -> dict[str, Any]:
    return parse_message_create(orjson.dumps(fields)).chat_request(LIMITS).model_dump(exclude_none=True)


def refused(fields: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_message_create(orjson.dumps(fields)).chat_request(LIMITS)
    return caught.value


def test_a_conversation_with_tools_becomes_its_chat_completion() -> None:
    request = chat(
        body(
            system=[
                {"type": "text", "text": "Be "},
                {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}},
            ],
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Quickly."},
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
                    ],
                },
            ],
            tools=[TOOL],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["a", "b", "c", "d", "e"],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            metadata={"user_id": "u-1"},
            stream=True,
        )
    )
    assert request["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}],
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        # Tool results first, as Anthropic orders a user turn; a failed one says so.
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": [{"type": "text", "text": "Quickly."}]},
    ]
    assert request["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["input_schema"]}}
    ]
    assert request["tool_choice"] == "required" and request["parallel_tool_calls"] is False
    assert request["stop"] == ["a", "b", "c", "d", "e"]  # Anthropic's bound, not OpenAI's four
    assert (request["max_tokens"], request["temperature"], request["top_p"], request["top_k"]) == (5, 0.5, 0.9, 40)
    assert request["user"] == "u-1" and request["stream"] is True


@pytest.mark.parametrize(
    ("choice", "chat_choice"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choices(choice: dict[str, Any], chat_choice: Any) -> None:
    request = chat(body(tools=[TOOL], tool_choice=choice))
    assert request["tool_choice"] == chat_choice and "parallel_tool_calls" not in request


def test_a_tool_result_alone_is_the_last_turn_and_count_tokens_asks_one_token() -> None:
    counted = parse_count_tokens(
        orjson.dumps(
            {
                "model": "m",
                "messages": [
                    USER,
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                ],
            }
        )
    ).chat_request(LIMITS)
    assert counted.max_tokens == 1 and counted.messages[-1].role == "tool" and counted.messages[-1].content == ""


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (body(extra=1), "extra", "Extra inputs are not permitted"),
        (body(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        ({"model": "m", "messages": [USER]}, "max_tokens", "Field required"),
        (body(temperature=1.5), "temperature", "less than or equal to 1"),
        (body(messages=[]), "messages", "at least 1"),
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            "messages.0.content.0.type",
            "'image' blocks are not supported",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "document"}]}]),
            "messages.0.content.0.type",
            "not supported",
        ),
        (
            body(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}],
                    }
                ]
            ),
            "messages.0.content.0.content.0.type",
            "'image' blocks are not supported",
        ),
        (
            body(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]),
            "messages.0.content.0.type",
            "blocks in user messages",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
            "messages.0.content.0.type",
            "go in assistant messages",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
            "messages.0.content.0.text",
            "Field required",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]),
            "messages.0.content.0.x",
            "Extra inputs",
        ),
        (body(messages=[USER, {"role": "assistant", "content": "Sure"}]), "messages.1.role", "prefilling"),
        (body(thinking={"type": "enabled", "budget_tokens": 2048}), "thinking", "not supported"),
        (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type", "only client tools"),
        (body(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools.0.type", "only client tools"),
        (
            body(tools=[{**TOOL, "input_schema": {"type": "object", "properties": {"a": {"type": 3}}}}]),
            "tools.0.input_schema",
            "Invalid JSON Schema",
        ),
        (body(tools=[{**TOOL, "input_schema": {"type": "array"}}]), "tools.0.input_schema.type", "'object'"),
        (body(tools=[{**TOOL, "name": "has space"}]), "tools.0.name", "pattern"),
        (body(tools=[TOOL, TOOL]), "tools.1.name", "Two tools"),
        (body(tool_choice={"type": "any"}), "tool_choice", "needs tools"),
        (body(tools=[TOOL], tool_choice={"type": "tool", "name": "other"}), "tool_choice.name", "not in tools"),
        (body(tool_choice={"type": "tool"}), "tool_choice.name", "Field required"),
        (body(stop_sequences=["s"] * 17), "stop_sequences", "at most 16"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field_first(fields: dict[str, Any], param: str, words: str) -> None:
    error = refused(fields)
    assert error.param == param and error.message.startswith(f"{param}: ") and words in error.message, error.message


def test_a_chat_requests_refusal_is_named_in_the_messages_terms() -> None:
    error = as_messages_error(InvalidRequest("Unsupported: stop.", param="stop"))
    assert (error.param, error.message) == ("stop_sequences", "stop_sequences: Unsupported: stop_sequences.")
    assert as_messages_error(InvalidRequest("n too large", param="messages.3.content")).param == "messages"
    assert as_messages_error(InvalidRequest("bad", param="user")).param == "metadata.user_id"


def test_not_json_is_a_400() -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_message_create(b"{")


@pytest.mark.parametrize(
    "fields",
    [
        body(),
        body(tools=[TOOL], tool_choice={"type": "any"}),
        body(tool_choice={"type": "auto"}),
        body(tool_choice={"type": "any"}),
        body(thinking={"type": "disabled"}),
        body(thinking={"type": "enabled", "budget_tokens": 1024}),
        body(messages=[{"role": "user", "content": [{"type": "image"}]}]),
        body(system=[{"type": "text", "text": "s"}], cache_control={"type": "ephemeral", "ttl": "1h"}),
        # An answer's blocks sent back as the SDK (or another client) dumped them.
        body(
            messages=[
                USER,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "t", "citations": None},
                        {"type": "tool_use", "id": "t", "name": "f", "input": {}, "caller": {"type": "direct"}},
                    ],
                },
                USER,
            ]
        ),
        body(
            messages=[{"role": "user", "content": [{"type": "text", "text": "t", "citations": [{"cited_text": "x"}]}]}]
        ),
    ],
)
def test_the_document_and_the_code_agree(fields: dict[str, Any]) -> None:
    documented = jsonschema_rs.validator_for(MessageCreate.model_json_schema()).is_valid(fields)
    try:
        parse_message_create(orjson.dumps(fields)).chat_request(LIMITS)
        accepted = True
    except InvalidRequest:
        accepted = False
    assert documented == accepted
    count = {k: v for k, v in fields.items() if k != "max_tokens"}
    assert jsonschema_rs.validator_for(CountTokensRequest.model_json_schema()).is_valid(count) == accepted


def test_a_tool_input_with_any_json_number_is_taken() -> None:
    """orjson writes no integer beyond 64 bits; the arguments are a JSON text, which the workers
    read with the standard library."""
    call = {"type": "tool_use", "id": "t", "name": "f", "input": {"n": 2**70, "city": "Zürich"}}
    raw = json.dumps(body(messages=[USER, {"role": "assistant", "content": [call]}, USER]))  # orjson cannot either
    request = parse_message_create(raw).chat_request(LIMITS)
    (tool_call,) = request.messages[1].tool_calls or []
    assert tool_call.function.arguments == '{"n":1180591620717411303424,"city":"Zürich"}'
