"""The validating transport: OpenAI answers pass through unchanged, departures raise and are kept."""

import json

import httpx
import openai
import pytest
from openai import OpenAI

from tests.contract.test_openai_shapes import CHAT, CHUNK, ERROR, MODELS, without
from tests.contract.transport import ContractTransport, shape_for


def sse(*events: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def serving(status: int, body: bytes, content_type: str = "application/json") -> ContractTransport:
    inner = httpx.MockTransport(
        lambda request: httpx.Response(status, content=body, headers={"content-type": content_type})
    )
    return ContractTransport(inner)


def sdk(transport: ContractTransport) -> OpenAI:
    return OpenAI(
        base_url="http://axon.test/v1", api_key="k", max_retries=0, http_client=httpx.Client(transport=transport)
    )


@pytest.mark.parametrize(
    ("path", "status", "streamed", "shape"),
    [
        ("/v1/chat/completions", 200, False, "CreateChatCompletionResponse"),
        ("/v1/chat/completions", 200, True, "CreateChatCompletionStreamResponse"),
        ("/v1/completions", 200, True, "CreateCompletionResponse"),
        ("/v1/models", 200, False, "ListModelsResponse"),
        ("/v1/models/sim-model", 200, False, "Model"),
        ("/v1/chat/completions", 400, False, "ErrorResponse"),
        ("/v1/sessions", 201, False, None),
        ("/health", 200, False, None),
    ],
)
def test_each_route_has_its_shape(path: str, status: int, streamed: bool, shape: str | None) -> None:
    assert shape_for(path, status, streamed=streamed) == shape


def test_an_openai_answer_reaches_the_sdk_unchanged_and_is_counted() -> None:
    transport = serving(200, json.dumps(CHAT).encode())
    answer = sdk(transport).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert transport.checked == {"CreateChatCompletionResponse": 1} and transport.violations == []


def test_an_answer_without_refusal_fails_the_call_and_is_kept() -> None:
    transport = serving(200, json.dumps(without(CHAT, "choices", 0, "message", "refusal")).encode())
    # The SDK reports any exception of its transport as a connection error caused by it.
    with pytest.raises(openai.APIConnectionError) as caught:
        sdk(transport).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert "'refusal' is a required property" in str(caught.value.__cause__)
    assert len(transport.violations) == 1


def test_chunks_are_checked_one_by_one_as_the_stream_is_read() -> None:
    good = serving(200, sse(CHUNK, CHUNK), "text/event-stream")
    chunks = list(sdk(good).chat.completions.create(model="m", messages=[], stream=True))
    assert len(chunks) == 2 and good.checked == {"CreateChatCompletionStreamResponse": 2}
    bad = serving(200, sse(CHUNK, without(CHUNK, "choices", 0, "index")), "text/event-stream")
    with pytest.raises(AssertionError, match="'index' is a required property"):
        list(sdk(bad).chat.completions.create(model="m", messages=[], stream=True))
    cut = serving(200, sse(CHUNK, done=False), "text/event-stream")
    with pytest.raises(AssertionError, match=r"without data: \[DONE\]"):
        list(sdk(cut).chat.completions.create(model="m", messages=[], stream=True))


def test_error_bodies_and_model_lists_are_checked_too() -> None:
    refused = serving(400, json.dumps(ERROR).encode())
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        sdk(refused).chat.completions.create(model="m", messages=[])
    assert refused.checked == {"ErrorResponse": 1}
    listed = serving(200, json.dumps(MODELS).encode())
    assert [m.id for m in sdk(listed).models.list()] == ["m"]
    bare = serving(400, json.dumps({"error": {"message": "m", "type": "t"}}).encode())
    with pytest.raises(openai.APIConnectionError):
        sdk(bare).chat.completions.create(model="m", messages=[])
    assert "'param' is a required property" in bare.violations[0]
