"""What the OpenAPI document says of a request body is what the session manager checks: for each
body below, the document's JSON Schema (the model's, as the gateway publishes it) and the code
agree on whether it is accepted. Each was a body the document accepted and the API refused
(issue 29, found by schemathesis), or its refusal by both."""

from typing import Any

import jsonschema_rs
import orjson
import pytest
from pydantic import BaseModel, ValidationError

from services.sessions.conversations.protocol import items_to_messages
from services.sessions.responses.protocol import input_messages
from services.sessions.responses.router import parse_response_create
from shared.conversation_requests import ConversationCreate, ConversationItemsCreate, ConversationUpdate
from shared.errors import InvalidRequest
from shared.openai_requests import ChatCompletionRequest, CompletionRequest, RequestLimits, parse_request
from shared.responses_requests import ResponseCreate
from shared.schemas import Message
from shared.session_requests import SessionCreate

LIMITS = RequestLimits()
USER = {"role": "user", "content": "hi"}


def _documented(model: type[BaseModel], body: dict[str, Any]) -> bool:
    return jsonschema_rs.validator_for(model.model_json_schema()).is_valid(body)


def _chat(body: dict[str, Any]) -> bool:
    try:
        parse_request("chat", orjson.dumps({"model": "m", **body}), LIMITS)
    except InvalidRequest:
        return False
    return True


def _completion(body: dict[str, Any]) -> bool:
    try:
        parse_request("completion", orjson.dumps({"model": "m", **body}), LIMITS)
    except InvalidRequest:
        return False
    return True


def _response(body: dict[str, Any]) -> bool:
    """Accepted up to the chat request it runs as (with no history: the cases below have none)."""
    try:
        request = parse_response_create(orjson.dumps({"model": "m", **body}))
        request.check()
        instructions = [Message(role="system", content=request.instructions)] if request.instructions else []
        request.chat_request([*instructions, *input_messages(request)], LIMITS)
    except InvalidRequest:
        return False
    return True


def _items(model: type[BaseModel], body: dict[str, Any]) -> bool:
    try:
        items_to_messages(model.model_validate(body).items or [])  # type: ignore[attr-defined]
    except (ValidationError, InvalidRequest):
        return False
    return True


def _validates(model: type[BaseModel], body: dict[str, Any]) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    ("body", "accepted"),
    [
        ({"messages": [USER]}, True),
        ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, False),  # a tool message needs content
        ({"messages": [{"role": "tool", "content": "x"}]}, False),  # ... and the call it answers
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": ""}]}, False),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, True),
        ({"messages": [{"role": "system"}]}, False),
        ({"messages": [{"role": "assistant"}]}, True),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, False),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, False),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, False),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, True),
        ({"messages": [USER], "logit_bias": {"12": 1}}, True),
        ({"messages": [USER], "logit_bias": {"a": 1}}, False),
        ({"messages": [USER], "top_logprobs": 2}, False),
        ({"messages": [USER], "top_logprobs": 2, "logprobs": True}, True),
        ({"messages": [USER], "tool_choice": "required"}, False),
        ({"messages": [USER], "tool_choice": "required", "tools": []}, False),
        ({"messages": [USER], "n": 2, "session_id": "s"}, False),
        ({"messages": [USER], "n": 1, "session_id": "s"}, True),
        ({"messages": [USER], "response_format": {"type": "json_schema"}}, False),
        ({"messages": [USER], "response_format": {"type": "json_object"}}, True),
    ],
)
def test_chat_completions(body: dict[str, Any], accepted: bool) -> None:
    assert _documented(ChatCompletionRequest, {"model": "m", **body}) is accepted
    assert _chat(body) is accepted


@pytest.mark.parametrize(("prompt", "accepted"), [("x", True), (["x"], True), ([], False), (["x", "y"], False)])
def test_completions_take_one_prompt(prompt: object, accepted: bool) -> None:
    assert _documented(CompletionRequest, {"model": "m", "prompt": prompt}) is accepted
    assert _completion({"prompt": prompt}) is accepted


@pytest.mark.parametrize(
    ("body", "accepted"),
    [
        ({"input": "hi"}, True),
        ({"input": []}, False),  # nothing to answer
        ({"input": [], "instructions": "Be brief."}, True),
        ({"input": [], "instructions": ""}, False),  # an empty system message is none
        ({"input": [{}]}, False),
        ({"input": [USER]}, True),  # a message's `type` may be left out, as OpenAI's EasyInputMessage
        ({"input": [{"type": "function_call_output", "call_id": "", "output": "x"}]}, False),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": None, "schema": {}}}}, False),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, False),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "ab", "schema": {}}}}, True),
        ({"input": "hi", "metadata": {"": "x"}}, False),
        ({"input": "hi", "metadata": {"k": "\u0000"}}, False),
        ({"input": "hi", "metadata": {"k": "v"}}, True),
        ({"input": "hi", "previous_response_id": "resp_1", "conversation": "conv_1"}, False),
        ({"input": "hi", "background": True, "store": False}, False),
        ({"input": "hi", "tool_choice": "required"}, False),
        ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, False),
    ],
)
def test_responses(body: dict[str, Any], accepted: bool) -> None:
    assert _documented(ResponseCreate, {"model": "m", **body}) is accepted
    assert _response(body) is accepted


@pytest.mark.parametrize(
    ("body", "accepted"),
    [
        ({"items": [{}]}, False),
        ({"items": [USER]}, True),
        ({"items": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]}, False),
        ({"items": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, True),
        ({"metadata": {"k" * 65: "v"}}, False),
        ({"metadata": {str(i): "v" for i in range(17)}}, False),
        ({"metadata": {"k": "v" * 513}}, False),
        ({"metadata": {"\u0000": "v"}}, False),
        ({"metadata": {"k": "v"}}, True),
    ],
)
def test_conversations(body: dict[str, Any], accepted: bool) -> None:
    assert _documented(ConversationCreate, body) is accepted
    assert _items(ConversationCreate, body) is accepted
    if "items" in body:
        assert _documented(ConversationItemsCreate, body) is accepted
        assert _items(ConversationItemsCreate, body) is accepted
    else:
        assert _documented(ConversationUpdate, body) is accepted
        assert _validates(ConversationUpdate, body) is accepted


@pytest.mark.parametrize(
    ("body", "accepted"), [({"title": None}, True), ({"title": "a\u0000"}, False), ({"model": "m", "title": "t"}, True)]
)
def test_sessions(body: dict[str, Any], accepted: bool) -> None:
    assert _documented(SessionCreate, body) is accepted
    assert _validates(SessionCreate, body) is accepted
