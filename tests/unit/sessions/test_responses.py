"""services/sessions/chat/protocol.py: OpenAI's chunks and responses, checked against OpenAI's own
schemas (tests/contract) and the `openai` SDK's types."""

import time

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.sessions.chat.protocol import (
    Answer,
    ResponseBuilder,
    request_usage,
    usage_dict,
    work_usage,
)
from services.sessions.sse import sse_event, sse_named_event
from shared.schemas import (
    FunctionCallDelta,
    PromptTokensDetails,
    TokenChunk,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tests.contract.openai_shapes import assert_openai_shape

CHUNK = "CreateChatCompletionStreamResponse"
CHAT = "CreateChatCompletionResponse"
TEXT = "CreateCompletionResponse"
ENVELOPE_KEYS = {"id", "object", "created", "model", "choices"}


def chunk(seq: int = 0, text: str = "", **fields: object) -> TokenChunk:
    return TokenChunk.model_validate({"seq": seq, "text": text, **fields})


def usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion)


def lp(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(
        token=token,
        logprob=logprob,
        bytes=list(token.encode()),
        top_logprobs=[TopLogprob(token=t, logprob=p, bytes=list(t.encode())) for t, p in top],
    )


def answer_of(index: int, *chunks: TokenChunk) -> Answer:
    """An answer fed as the service feeds it."""
    answer = Answer(index)
    for c in chunks:
        answer.text.append(c.text)
        if c.tool_calls is not None:
            answer.add_tool_calls(c.tool_calls)
        if c.logprobs is not None:
            answer.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            answer.finish_reason = c.finish_reason
    return answer


def call_start(index: int, call_id: str, name: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=call_id, type="function", function=FunctionCallDelta(name=name))


def call_args(index: int, piece: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=piece))


# Plain chat -----------------------------------------------------------------------------------


def test_chat_chunks_share_id_and_created_and_validate() -> None:
    before = int(time.time())
    builder = ResponseBuilder(kind="chat", job_id="abc", model="smollm2")
    first = builder.chunk(0, chunk(0, "Hel"), first=True)
    second = builder.chunk(0, chunk(1, "lo"), first=False)
    last = builder.chunk(0, chunk(2, "", finish_reason="stop"), first=False)
    assert set(first) == ENVELOPE_KEYS
    assert first["id"] == "chatcmpl-abc" and first["object"] == "chat.completion.chunk"
    assert before <= first["created"] <= int(time.time())
    assert {(c["id"], c["created"]) for c in (first, second, last)} == {(first["id"], first["created"])}
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None, "finish_reason": None}
    ]
    assert second["choices"][0]["delta"] == {"content": "lo"}
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    for body in (first, second, last):
        assert_openai_shape(CHUNK, body)
        ChatCompletionChunk.model_validate(body)


def test_a_final_chunk_with_text_keeps_it_and_a_cancelled_answer_stopped() -> None:
    builder = ResponseBuilder(kind="chat", job_id="j", model="m")
    final = builder.chunk(0, chunk(3, "end", finish_reason="cancelled"), first=False)
    assert final["choices"][0]["delta"] == {"content": "end"}
    assert final["choices"][0]["finish_reason"] == "stop"


def test_the_only_chunk_of_an_empty_answer_still_names_the_role() -> None:
    only = ResponseBuilder(kind="chat", job_id="j", model="m").chunk(0, chunk(0, finish_reason="length"), first=True)
    assert only["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert_openai_shape(CHUNK, only)


def test_chat_response_has_a_null_refusal_and_validates() -> None:
    builder = ResponseBuilder(kind="chat", job_id="j", model="m")
    body = builder.response([answer_of(0, chunk(0, "Hello"), chunk(1, "!", finish_reason="stop"))], usage(10, 3))
    assert set(body) == ENVELOPE_KEYS | {"usage"}
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert_openai_shape(CHAT, body)
    assert ChatCompletion.model_validate(body).choices[0].message.content == "Hello!"


def test_include_usage_ends_the_stream_with_the_usage_chunk() -> None:
    builder = ResponseBuilder(kind="chat", job_id="j", model="m", include_usage=True)
    body = builder.chunk(0, chunk(0, "a"), first=True)
    assert "usage" not in body  # OpenAI's schema has no null for it
    usage = builder.usage_chunk(Usage(prompt_tokens=21, completion_tokens=17))
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 21, "completion_tokens": 17, "total_tokens": 38}
    for b in (body, usage):
        assert_openai_shape(CHUNK, b)
        ChatCompletionChunk.model_validate(b)


def test_cached_prompt_tokens_are_reported_when_known() -> None:
    usage = Usage(prompt_tokens=30, completion_tokens=2, prompt_tokens_details=PromptTokensDetails(cached_tokens=16))
    assert usage_dict(usage)["prompt_tokens_details"] == {"cached_tokens": 16}
    assert "prompt_tokens_details" not in usage_dict(Usage(prompt_tokens=1))
    body = ResponseBuilder(kind="completion", job_id="j", model="m").usage_chunk(usage)
    assert body["object"] == "text_completion"
    parsed = ChatCompletion.model_validate(
        ResponseBuilder(kind="chat", job_id="j", model="m").response([answer_of(0, chunk(0, "x"))], usage)
    )
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 16


# Tool calls -------------------------------------------------------------------------------------


def test_streamed_tool_calls_take_openais_shape() -> None:
    builder = ResponseBuilder(kind="chat", job_id="j", model="m")
    opening = builder.chunk(0, chunk(0, tool_calls=[call_start(0, "call_a", "get_weather")]), first=True)
    piece = builder.chunk(0, chunk(1, tool_calls=[call_args(0, '{"city": ')]), first=False)
    end = builder.chunk(0, chunk(2, tool_calls=[call_args(0, '"Paris"}')], finish_reason="tool_calls"), first=False)
    # The first delta names the call (arguments start empty); the role opens the choice, no content.
    assert opening["choices"][0]["delta"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        ],
    }
    assert piece["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}
    assert end["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}
    assert end["choices"][0]["finish_reason"] == "tool_calls"
    for body in (opening, piece, end):
        assert_openai_shape(CHUNK, body)
        ChatCompletionChunk.model_validate(body)


def test_a_delta_without_type_gets_it_with_its_id() -> None:
    delta = ToolCallDelta(index=1, id="call_b", function=FunctionCallDelta(name="f", arguments="{}"))
    body = ResponseBuilder(kind="chat", job_id="j", model="m").chunk(0, chunk(0, "x", tool_calls=[delta]), first=False)
    assert body["choices"][0]["delta"] == {
        "content": "x",
        "tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


def test_tool_calls_are_merged_from_their_deltas_by_index() -> None:
    # Two parallel calls whose pieces interleave, the second announced first.
    answer = answer_of(
        0,
        chunk(0, tool_calls=[call_start(1, "call_2", "get_time"), call_start(0, "call_1", "get_weather")]),
        chunk(1, tool_calls=[call_args(0, '{"city"'), call_args(1, '{"tz": "UTC"}')]),
        chunk(2, tool_calls=[call_args(0, ': "Paris"}')], finish_reason="tool_calls"),
    )
    calls = answer.tool_calls
    assert calls is not None
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in calls] == [
        ("call_1", "function", "get_weather", '{"city": "Paris"}'),
        ("call_2", "function", "get_time", '{"tz": "UTC"}'),
    ]
    body = ResponseBuilder(kind="chat", job_id="j", model="m").response([answer], usage(5, 9))
    message = body["choices"][0]["message"]
    assert message["content"] is None  # only tool calls: no content, as OpenAI's
    assert message["refusal"] is None
    assert message["tool_calls"] == [c.model_dump() for c in calls]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert_openai_shape(CHAT, body)
    parsed = ChatCompletion.model_validate(body).choices[0].message
    assert parsed.tool_calls is not None and parsed.tool_calls[1].function.name == "get_time"


def test_an_answer_with_text_and_a_call_keeps_both_and_one_without_calls_has_no_tool_calls_key() -> None:
    with_call = answer_of(
        0,
        chunk(0, "Let me check. "),
        chunk(1, tool_calls=[call_start(0, "call_1", "f"), call_args(0, "{}")], finish_reason="stop"),
    )
    builder = ResponseBuilder(kind="chat", job_id="j", model="m")
    message = builder.response([with_call], None)["choices"][0]["message"]
    assert message["content"] == "Let me check. "
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    plain = builder.response([answer_of(0, chunk(0, "hi", finish_reason="stop"))], None)["choices"][0]["message"]
    assert "tool_calls" not in plain
    assert answer_of(0, chunk(0, "hi")).tool_calls is None


# Logprobs ---------------------------------------------------------------------------------------


def test_chat_logprobs_are_openais_object_when_asked_for_and_null_otherwise() -> None:
    tokens = [lp("Hi", -0.25, ("Hi", -0.25), ("Hello", -1.5)), lp("!", -0.5)]
    with_logprobs = ResponseBuilder(kind="chat", job_id="j", model="m", logprobs=True)
    streamed = with_logprobs.chunk(0, chunk(0, "Hi!", logprobs=tokens), first=True)
    assert streamed["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.25,
                "bytes": [72, 105],
                "top_logprobs": [
                    {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                    {"token": "Hello", "logprob": -1.5, "bytes": [72, 101, 108, 108, 111]},
                ],
            },
            {"token": "!", "logprob": -0.5, "bytes": [33], "top_logprobs": []},
        ],
        "refusal": None,
    }
    final = with_logprobs.chunk(0, chunk(1, finish_reason="stop"), first=False)
    assert final["choices"][0]["logprobs"] is None  # no token in it
    whole = with_logprobs.response([answer_of(0, chunk(0, "Hi!", logprobs=tokens, finish_reason="stop"))], None)
    assert whole["choices"][0]["logprobs"] == streamed["choices"][0]["logprobs"]
    for body in (streamed, final):
        assert_openai_shape(CHUNK, body)
        ChatCompletionChunk.model_validate(body)
    assert_openai_shape(CHAT, whole)
    assert ChatCompletion.model_validate(whole).choices[0].logprobs is not None

    without = ResponseBuilder(kind="chat", job_id="j", model="m")
    assert without.chunk(0, chunk(0, "Hi!", logprobs=tokens), first=True)["choices"][0]["logprobs"] is None
    assert without.response([answer_of(0, chunk(0, "Hi!"))], None)["choices"][0]["logprobs"] is None


def test_completion_logprobs_are_the_legacy_shape_with_offsets_into_the_text() -> None:
    builder = ResponseBuilder(kind="completion", job_id="j", model="m", logprobs=True)
    pieces = [
        chunk(0, "Once", logprobs=[lp("Once", -0.1, ("Once", -0.1), ("One", -2.0))]),
        chunk(1, " upon a", logprobs=[lp(" upon", -0.2, ("Upon", -1.0)), lp(" a", -0.3, (" a", -0.3))]),
        chunk(2, " time", logprobs=[lp(" time", -0.4)], finish_reason="length"),
    ]
    streamed = [builder.chunk(0, p, first=i == 0)["choices"][0] for i, p in enumerate(pieces)]
    text = "".join(c["text"] for c in streamed)
    tokens = [t for c in streamed for t in c["logprobs"]["tokens"]]
    offsets = [o for c in streamed for o in c["logprobs"]["text_offset"]]
    assert tokens == ["Once", " upon", " a", " time"]
    assert offsets == [0, 4, 9, 11]
    assert all(text[o : o + len(t)] == t for t, o in zip(tokens, offsets, strict=True))
    # The k most likely and the sampled token, each to its logprob.
    assert streamed[1]["logprobs"]["top_logprobs"] == [{"Upon": -1.0, " upon": -0.2}, {" a": -0.3}]
    assert streamed[1]["logprobs"]["token_logprobs"] == [-0.2, -0.3]
    whole = builder.response([answer_of(0, *pieces)], usage(2, 4))
    logprobs = whole["choices"][0]["logprobs"]
    assert logprobs["tokens"] == tokens and logprobs["text_offset"] == offsets
    assert logprobs["top_logprobs"][0] == {"Once": -0.1, "One": -2.0}
    # (The document types a completion's finish_reason as non-null: the final chunk is checked.)
    final = ResponseBuilder(kind="completion", job_id="j", model="m", logprobs=True).chunk(0, pieces[-1], first=False)
    for body in (final, whole):
        assert_openai_shape(TEXT, body)
    assert Completion.model_validate(whole).choices[0].logprobs is not None
    plain = ResponseBuilder(kind="completion", job_id="j", model="m").response([answer_of(0, *pieces)], None)
    assert plain["choices"][0]["logprobs"] is None


def test_an_echoed_prompt_and_its_logprobs_are_offset_from_the_start_of_the_text() -> None:
    # With `echo`, the worker's first chunk starts with the prompt, and its logprobs with the
    # prompt's (TokenChunk's contract).
    first = chunk(
        0, "The sky is blue", logprobs=[lp("The", -9.0), lp(" sky", -3.0), lp(" is", -1.0), lp(" blue", -0.5)]
    )
    last = chunk(1, ".", logprobs=[lp(".", -0.1)], finish_reason="stop")
    builder = ResponseBuilder(kind="completion", job_id="j", model="m", logprobs=True)
    streamed = [builder.chunk(0, first, first=True), builder.chunk(0, last, first=False)]
    assert [b["choices"][0]["text"] for b in streamed] == ["The sky is blue", "."]
    assert streamed[0]["choices"][0]["logprobs"]["tokens"] == ["The", " sky", " is", " blue"]
    assert streamed[0]["choices"][0]["logprobs"]["text_offset"] == [0, 3, 7, 10]
    assert streamed[1]["choices"][0]["logprobs"]["text_offset"] == [15]
    whole = builder.response([answer_of(0, first, last)], usage(3, 2))
    assert whole["choices"][0]["text"] == "The sky is blue."
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 3, 7, 10, 15]
    assert_openai_shape(TEXT, whole)


# n choices -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_each_choice_has_its_index_and_the_response_lists_them_in_order(kind: str) -> None:
    builder = ResponseBuilder(kind=kind, job_id="j", model="m")  # type: ignore[arg-type]
    shape = CHUNK if kind == "chat" else TEXT
    for index in (2, 0, 1):
        body = builder.chunk(index, chunk(0, f"c{index}"), first=True)
        assert [c["index"] for c in body["choices"]] == [index]
        if kind == "chat":
            assert body["choices"][0]["delta"]["role"] == "assistant"  # the first chunk of every choice
            assert_openai_shape(shape, body)
    answers = [answer_of(i, chunk(0, f"answer {i}", finish_reason="length" if i else "stop")) for i in (2, 0, 1)]
    body = builder.response(answers, usage(4, 9))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = (
        [c["message"]["content"] for c in body["choices"]] if kind == "chat" else [c["text"] for c in body["choices"]]
    )
    assert texts == ["answer 0", "answer 1", "answer 2"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "length"]
    assert_openai_shape(CHAT if kind == "chat" else TEXT, body)


def test_logprob_offsets_are_kept_per_choice() -> None:
    builder = ResponseBuilder(kind="completion", job_id="j", model="m", logprobs=True)
    a0 = builder.chunk(0, chunk(0, "Pa", logprobs=[lp("P", -1.0), lp("a", -0.1)]), first=True)["choices"][0]
    b0 = builder.chunk(1, chunk(0, "Pbb", logprobs=[lp("P", -1.0), lp("bb", -0.2)]), first=True)["choices"][0]
    a1 = builder.chunk(0, chunk(1, "c", logprobs=[lp("c", -0.3)]), first=False)["choices"][0]
    assert (a0["logprobs"]["text_offset"], b0["logprobs"]["text_offset"]) == ([0, 1], [0, 1])
    assert a1["logprobs"]["text_offset"] == [2]  # after choice 0's "Pa", whatever choice 1 sent


def test_a_requests_usage_counts_its_prompt_once_and_every_choices_completion() -> None:
    cached = PromptTokensDetails
    usages = [
        Usage(prompt_tokens=12, completion_tokens=5, prompt_tokens_details=cached(cached_tokens=0)),
        Usage(prompt_tokens=12, completion_tokens=7, prompt_tokens_details=cached(cached_tokens=12)),
        None,  # a choice that never finished
    ]
    total = request_usage(usages)
    assert total == Usage(prompt_tokens=12, completion_tokens=12, prompt_tokens_details=cached(cached_tokens=0))
    assert request_usage([None, None]) is None
    only = Usage(prompt_tokens=3, completion_tokens=4)
    assert request_usage([only]) is only
    assert request_usage([only, Usage(prompt_tokens=3, completion_tokens=1)]) == Usage(
        prompt_tokens=3, completion_tokens=5
    )
    # What the platform did (the rate-limit charge and the usage record): every job's prompt too.
    assert work_usage(usages) == Usage(prompt_tokens=24, completion_tokens=12)
    assert work_usage([only]) is only and work_usage([None]) is None


@pytest.mark.parametrize("seq", [0, 7, 4095, 4096, 123456])
def test_an_event_has_its_seq_as_its_id(seq: int) -> None:
    assert sse_event(seq, {"a": 1}) == b'id: %d\ndata: {"a":1}\n\n' % seq
    assert sse_named_event(b"%d.1" % seq, {"a": 1}) == b'id: %d.1\ndata: {"a":1}\n\n' % seq
