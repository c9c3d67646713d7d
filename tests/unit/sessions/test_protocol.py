"""services.sessions.protocol: OpenAI chunks and responses out (requests: tests/unit/shared/test_openai_requests.py)."""

import time

import pytest

from services.sessions.protocol import ResponseBuilder

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
