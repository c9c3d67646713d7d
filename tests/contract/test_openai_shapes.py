"""The contract validator itself: OpenAI's own shapes pass, each kind of departure is caught."""

import copy
import json

import pytest

from tests.contract.openai_shapes import (
    SHAPES,
    SUBSET_PATH,
    assert_openai_shape,
    assert_openai_stream,
    openai_shape_errors,
    to_json_schema,
)

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
LOGPROB = {
    "token": "Hi",
    "logprob": -0.1,
    "bytes": [72, 105],
    "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}],
}
CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "logprobs": {"content": [LOGPROB], "refusal": None},
            "message": {"role": "assistant", "content": None, "refusal": None, "tool_calls": [TOOL_CALL]},
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
CHUNK = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1700000000,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "finish_reason": None,
            "delta": {
                "role": "assistant",
                "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}],
            },
        }
    ],
}
COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1700000000,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "text": " there",
            "finish_reason": "length",
            "logprobs": {
                "tokens": [" there"],
                "token_logprobs": [-0.5],
                "top_logprobs": [{" there": -0.5}],
                "text_offset": [2],
            },
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "axon"}]}
ERROR = {
    "error": {
        "message": "Unrecognized request argument supplied: foo",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
}
GOOD = {
    "CreateChatCompletionResponse": CHAT,
    "CreateChatCompletionStreamResponse": CHUNK,
    "CreateCompletionResponse": COMPLETION,
    "ListModelsResponse": MODELS,
    "Model": MODELS["data"][0],
    "ErrorResponse": ERROR,
}


def without(body: dict, *path: str | int) -> dict:
    """A deep copy of `body` with the key at `path` removed."""
    out = copy.deepcopy(body)
    node = out
    for step in path[:-1]:
        node = node[step]
    del node[path[-1]]
    return out


def replaced(body: dict, value: object, *path: str | int) -> dict:
    out = copy.deepcopy(body)
    node = out
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return out


def test_the_vendored_subset_names_its_source() -> None:
    source = json.loads(SUBSET_PATH.read_text())["x-source"]
    assert source["repository"] == "openai/openai-openapi"
    assert source["version"] == "2.3.0"
    assert len(source["commit"]) == 40


@pytest.mark.parametrize("name", SHAPES)
def test_openai_shaped_bodies_pass(name: str) -> None:
    assert_openai_shape(name, GOOD[name])


@pytest.mark.parametrize(
    ("name", "body", "complaint"),
    [
        # Axon's one deviation before issue 21: `refusal` is required (nullable).
        ("CreateChatCompletionResponse", without(CHAT, "choices", 0, "message", "refusal"), "'refusal' is a required"),
        ("CreateChatCompletionResponse", without(CHAT, "choices", 0, "logprobs"), "'logprobs' is a required"),
        ("CreateChatCompletionResponse", replaced(CHAT, None, "choices", 0, "finish_reason"), "None is not one of"),
        ("CreateChatCompletionResponse", replaced(CHAT, "cancelled", "choices", 0, "finish_reason"), "is not one of"),
        (
            "CreateChatCompletionResponse",
            replaced(CHAT, {"city": "Paris"}, "choices", 0, "message", "tool_calls", 0, "function", "arguments"),
            "is not of type 'string'",
        ),
        (
            "CreateChatCompletionResponse",
            without(CHAT, "choices", 0, "logprobs", "content", 0, "top_logprobs"),
            "'top_logprobs' is a required",
        ),
        (
            "CreateChatCompletionStreamResponse",
            without(CHUNK, "choices", 0, "delta", "tool_calls", 0, "index"),
            "'index'",
        ),
        ("CreateChatCompletionStreamResponse", replaced(CHUNK, "chat.completion", "object"), "is not one of"),
        ("CreateCompletionResponse", without(COMPLETION, "choices", 0, "text"), "'text' is a required"),
        (
            "CreateCompletionResponse",
            replaced(COMPLETION, "tool_calls", "choices", 0, "finish_reason"),
            "is not one of",
        ),
        ("ListModelsResponse", without(MODELS, "data", 0, "owned_by"), "'owned_by' is a required"),
        ("Model", replaced(MODELS["data"][0], "2024-01-01", "created"), "is not of type 'integer'"),
        ("ErrorResponse", without(ERROR, "error", "code"), "'code' is a required"),
        ("ErrorResponse", without(ERROR, "error", "param"), "'param' is a required"),
    ],
)
def test_each_departure_is_caught_with_its_path(name: str, body: dict, complaint: str) -> None:
    errors = openai_shape_errors(name, body)
    assert errors and any(complaint in e for e in errors), errors
    with pytest.raises(AssertionError, match=name):
        assert_openai_shape(name, body)


def test_nullable_becomes_a_null_type_and_keeps_enums() -> None:
    converted = to_json_schema(
        {
            "type": "string",
            "enum": ["stop"],
            "nullable": True,
            "x-oaiMeta": {},
            "items": {"$ref": "#/components/schemas/X"},
        }
    )
    assert converted == {"type": ["string", "null"], "enum": ["stop", None], "items": {"$ref": "#/$defs/X"}}
    assert to_json_schema({"$ref": "#/components/schemas/X", "nullable": True}) == {
        "anyOf": [{"$ref": "#/$defs/X"}, {"type": "null"}]
    }


def test_a_stream_is_validated_chunk_by_chunk_and_must_end_with_done() -> None:
    lines = [f"data: {json.dumps(CHUNK)}", "", f"data: {json.dumps(ERROR)}", "data: [DONE]"]
    assert assert_openai_stream("CreateChatCompletionStreamResponse", lines) == [CHUNK, ERROR]
    bad = replaced(CHUNK, "x", "choices", 0, "delta", "role")
    with pytest.raises(AssertionError, match="is not one of"):
        assert_openai_stream("CreateChatCompletionStreamResponse", [f"data: {json.dumps(bad)}", "data: [DONE]"])
    with pytest.raises(AssertionError, match=r"\[DONE\]"):
        assert_openai_stream("CreateChatCompletionStreamResponse", [f"data: {json.dumps(CHUNK)}"])


def test_an_unknown_shape_name_is_refused() -> None:
    with pytest.raises(KeyError):
        openai_shape_errors("CreateEmbeddingResponse", {})
