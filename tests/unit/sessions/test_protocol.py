"""services.sessions.protocol: OpenAI request bodies in, OpenAI chunks and responses out."""

import time

import pytest
from pydantic import ValidationError

from services.sessions.protocol import ChatCompletionRequest, CompletionRequest, ResponseBuilder
from shared.errors import InvalidRequest
from shared.schemas import Message

# ChatCompletionRequest --------------------------------------------------------------------


def chat(**overrides: object) -> ChatCompletionRequest:
    body: dict[str, object] = {"model": "smollm2", "messages": [{"role": "user", "content": "Hello"}]}
    body.update(overrides)
    return ChatCompletionRequest.model_validate(body)


def test_typical_openai_chat_body_is_accepted() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi", "name": "alice"},
            {"role": "assistant", "content": None},
        ],
        temperature=0,
        top_p=0.9,
        max_tokens=32,
        stop="\n",
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        user="someone",  # unknown OpenAI fields are ignored
        presence_penalty=0.0,
    )
    assert [m.to_message(i) for i, m in enumerate(request.messages)] == [
        Message(role="system", content="Be brief."),
        Message(role="user", content="Hi"),
        Message(role="assistant", content=""),
    ]
    assert request.stop_list == ["\n"]
    assert request.include_usage
    assert request.requested_max_tokens == 32
    assert request.stream


def test_text_content_parts_are_flattened() -> None:
    request = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}]
    )
    assert request.messages[0].to_message(0) == Message(role="user", content="Hello, world")


def test_image_content_part_is_an_invalid_request() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "You see images."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                ],
            },
        ]
    )
    with pytest.raises(InvalidRequest) as info:
        request.messages[1].to_message(1)
    assert info.value.status_code == 400
    assert info.value.param == "messages.1.content"


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=10, max_completion_tokens=20).requested_max_tokens == 20
    assert chat().requested_max_tokens is None


def test_defaults() -> None:
    request = chat()
    assert request.stop_list == []
    assert not request.include_usage
    assert not request.stream
    assert request.session_id is None
    assert request.n == 1


def test_n_1_is_accepted_and_n_2_rejected() -> None:
    assert chat(n=1).n == 1
    with pytest.raises(ValidationError) as info:
        chat(n=2)
    assert info.value.errors()[0]["loc"] == ("n",)


def test_four_stops_accepted_five_rejected() -> None:
    assert chat(stop=["a", "b", "c", "d"]).stop_list == ["a", "b", "c", "d"]
    with pytest.raises(ValidationError) as info:
        chat(stop=["a", "b", "c", "d", "e"])
    assert info.value.errors()[0]["loc"] == ("stop",)


@pytest.mark.parametrize(
    "overrides",
    [
        {"messages": []},
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"model": ""},
        {"temperature": 2.5},
        {"top_p": 0},
        {"max_tokens": 0},
        {"max_completion_tokens": 0},
    ],
)
def test_invalid_chat_bodies_are_rejected(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        chat(**overrides)


def test_missing_messages_is_rejected() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "smollm2"})


# CompletionRequest ------------------------------------------------------------------------


def test_completion_with_a_string_prompt() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "Once upon", "max_tokens": 5})
    assert request.prompt_text == "Once upon"
    assert request.requested_max_tokens == 5


def test_completion_with_a_list_of_one_prompt() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": ["Once upon"]})
    assert request.prompt_text == "Once upon"


@pytest.mark.parametrize("prompt", [[], ["a", "b"]])
def test_completion_needs_exactly_one_prompt(prompt: list[str]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})


def test_completion_shares_the_stop_limit() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": list("abcde")})


# ResponseBuilder --------------------------------------------------------------------------

ENVELOPE_KEYS = {"id", "object", "created", "model", "choices"}


def test_chat_ids_and_envelope() -> None:
    before = int(time.time())
    builder = ResponseBuilder(kind="chat", job_id="abc", model="smollm2")
    chunk = builder.chunk("Hi", None, first=True)
    assert set(chunk) == ENVELOPE_KEYS
    assert chunk["id"] == "chatcmpl-abc"
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["model"] == "smollm2"
    assert before <= chunk["created"] <= int(time.time())
    # Every chunk of one request shares id and created.
    later = builder.chunk("!", None, first=False)
    assert (later["id"], later["created"]) == (chunk["id"], chunk["created"])


def test_first_chat_chunk_carries_the_assistant_role() -> None:
    builder = ResponseBuilder(kind="chat", job_id="abc", model="m")
    first = builder.chunk("Hel", None, first=True)
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None, "finish_reason": None}
    ]
    second = builder.chunk("lo", None, first=False)
    assert second["choices"][0]["delta"] == {"content": "lo"}


def test_final_chat_chunk_without_text_has_an_empty_delta() -> None:
    builder = ResponseBuilder(kind="chat", job_id="abc", model="m")
    final = builder.chunk("", "stop", first=False)
    assert final["choices"][0]["delta"] == {}
    assert final["choices"][0]["finish_reason"] == "stop"


def test_final_chat_chunk_with_text_keeps_it() -> None:
    builder = ResponseBuilder(kind="chat", job_id="abc", model="m")
    final = builder.chunk("end", "length", first=False)
    assert final["choices"][0]["delta"] == {"content": "end"}
    assert final["choices"][0]["finish_reason"] == "length"


def test_only_chunk_of_an_empty_answer_still_names_the_role() -> None:
    builder = ResponseBuilder(kind="chat", job_id="abc", model="m")
    only = builder.chunk("", "stop", first=True)
    assert only["choices"][0]["delta"]["role"] == "assistant"


def test_completion_chunk_shape() -> None:
    builder = ResponseBuilder(kind="completion", job_id="xyz", model="m")
    chunk = builder.chunk("text", "length", first=True)
    assert chunk["id"] == "cmpl-xyz"
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "text", "logprobs": None, "finish_reason": "length"}]


@pytest.mark.parametrize(("kind", "obj"), [("chat", "chat.completion.chunk"), ("completion", "text_completion")])
def test_usage_chunk(kind: str, obj: str) -> None:
    body = ResponseBuilder(kind=kind, job_id="j", model="m").usage_chunk(21, 17)
    assert body["object"] == obj
    assert body["choices"] == []
    assert body["usage"] == {"prompt_tokens": 21, "completion_tokens": 17, "total_tokens": 38}


def test_chat_response_shape() -> None:
    body = ResponseBuilder(kind="chat", job_id="j", model="m").response("Hello!", "stop", 10, 3)
    assert set(body) == ENVELOPE_KEYS | {"usage"}
    assert body["object"] == "chat.completion"
    assert body["id"] == "chatcmpl-j"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}


def test_completion_response_shape() -> None:
    body = ResponseBuilder(kind="completion", job_id="j", model="m").response("Once", "length", 4, 1)
    assert body["object"] == "text_completion"
    assert body["id"] == "cmpl-j"
    assert body["choices"] == [{"index": 0, "text": "Once", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["total_tokens"] == 5


def test_bodies_validate_against_the_official_openai_types() -> None:
    openai_types = pytest.importorskip("openai.types")
    chat_builder = ResponseBuilder(kind="chat", job_id="j", model="m")
    for chunk in (
        chat_builder.chunk("Hi", None, first=True),
        chat_builder.chunk(" there", None, first=False),
        chat_builder.chunk("", "stop", first=False),
        chat_builder.usage_chunk(3, 2),
    ):
        openai_types.chat.ChatCompletionChunk.model_validate(chunk)
    response = openai_types.chat.ChatCompletion.model_validate(chat_builder.response("Hi", "length", 3, 2))
    assert response.choices[0].message.content == "Hi"
    assert response.usage is not None and response.usage.total_tokens == 5

    text_builder = ResponseBuilder(kind="completion", job_id="j", model="m")
    # (The SDK types a completion's finish_reason as non-null, so only the last chunk is checked.)
    openai_types.Completion.model_validate(text_builder.chunk("a", "length", first=True))
    completion = openai_types.Completion.model_validate(text_builder.response("abc", "stop", 1, 3))
    assert completion.choices[0].text == "abc"
