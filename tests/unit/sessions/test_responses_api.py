"""The Responses API's mapping onto the chat machinery: a request body -> the chat request (and so
the job) it runs as; an answer -> OpenAI's Response object, checked with the SDK's models."""

import json
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter
from redis.exceptions import RedisError

from services.gateway.proxy import _stream_end, estimate_prompt_tokens, most_tokens
from services.sessions.chat.protocol import Answer
from services.sessions.responses.events import ResponseEvents
from services.sessions.responses.protocol import (
    answer_message,
    finished_response,
    input_messages,
    message_items,
    response_object,
    skeleton_of,
    status_of,
    usage_object,
)
from services.sessions.responses.replay import ResponseReplays
from services.sessions.responses.router import parse_response_create
from services.sessions.responses.service import ResponsesService, Target
from services.sessions.responses.store import StoredResponse
from services.sessions.run_on import RunOn
from services.sessions.turns import fit_history
from shared.errors import InvalidRequest, Unavailable
from shared.openai_requests import RequestLimits
from shared.responses_requests import ResponseCreate, as_response_error, response_param
from shared.schemas import (
    FunctionCall,
    FunctionCallDelta,
    JsonSchemaFormat,
    Message,
    NamedToolChoice,
    PromptTokensDetails,
    TokenChunk,
    ToolCall,
    ToolCallDelta,
    Usage,
)

LIMITS = RequestLimits()
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}, "strict": True}


def _body(**fields: object) -> ResponseCreate:
    return ResponseCreate.model_validate({"model": "m", "input": "hi", **fields})


def test_a_string_input_is_one_user_message_and_instructions_lead() -> None:
    body = _body(instructions="Be brief.", max_output_tokens=7, temperature=0.3, top_p=0.5, user="u")
    messages = [Message(role="system", content="Be brief."), *input_messages(body)]
    chat = body.chat_request(messages, LIMITS)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "hi")]
    assert chat.requested_max_tokens == 7 and chat.user == "u"
    sampling = chat.sampling(7)
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.3, 0.5, 7)
    assert chat.tool_specs() is None and chat.job_response_format() is None


def test_items_become_messages_with_tool_calls() -> None:
    body = _body(
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "22 C"},
        ]
    )
    messages = input_messages(body)
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].tool_calls is not None and messages[1].tool_calls[0].id == "c1"
    assert messages[2].tool_call_id == "c1"
    items = message_items(messages)
    assert [i["type"] for i in items] == ["message", "function_call", "function_call_output"]
    assert len({i["id"] for i in items}) == 3


def test_unknown_item_type_names_the_param() -> None:
    with pytest.raises(InvalidRequest) as caught:
        input_messages(_body(input=[{"role": "user", "content": "a"}, {"type": "reasoning"}]))
    assert caught.value.param == "input[1].type"


def test_tools_tool_choice_and_text_format_map_onto_the_chat_request() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = _body(
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
    )
    chat = body.chat_request(input_messages(body), LIMITS)
    specs = chat.tool_specs()
    assert specs is not None and specs[0].name == "get_weather"
    assert chat.job_tool_choice() == NamedToolChoice(name="get_weather") and chat.parallel_calls is False
    fmt = chat.job_response_format()
    assert fmt is not None and fmt.type == "json_schema"
    assert fmt.json_schema == JsonSchemaFormat(name="out", schema_=schema, strict=True)
    json_object = _body(text={"format": {"type": "json_object"}})
    fmt = json_object.chat_request(input_messages(json_object), LIMITS).job_response_format()
    assert fmt is not None and fmt.type == "json_object"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format"),
        ({"input": []}, "input"),  # and no history: no message at all
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]}, "input[0].content[0].text"),
        ({"tools": [{**TOOL, "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [{**TOOL, "parameters": {"type": 5}}]}, "tools[0].parameters"),
        ({"tools": [TOOL, TOOL]}, "tools[1].name"),
    ],
)
def test_chat_rules_still_hold_naming_the_responses_param(fields: dict, param: str) -> None:
    body = _body(**fields)
    with pytest.raises(InvalidRequest) as caught:
        body.chat_request(input_messages(body), LIMITS)
    assert caught.value.param == param
    assert "messages" not in caught.value.message and "function" not in str(caught.value.param)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "m", "input": "x", "background": true, "store": false}', "background"),
        (
            b'{"model": "m", "input": "x", "previous_response_id": "resp_1", "conversation": "conv_1"}',
            "previous_response_id",
        ),
        (b'{"model": "m", "input": "x", "reasoning": {}}', None),  # unknown: named in the message only, as OpenAI does
        (b'{"model": "m"}', "input"),
    ],
)
def test_bad_bodies(raw: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_response_create(raw).check()
    assert caught.value.param == param


def test_response_object_follows_the_sdk_model() -> None:
    body = _body(tools=[TOOL], instructions="x", max_output_tokens=3, metadata={"a": "b"}, store=False)
    answer = Answer(0)
    answer.text.append("Hello there")
    answer.add_tool_calls([])
    reply = answer_message(answer)
    usage = Usage(prompt_tokens=10, completion_tokens=3, prompt_tokens_details=PromptTokensDetails(cached_tokens=4))
    payload = response_object(
        body,
        response_id="resp_1",
        created_at=1.0,
        status="incomplete",
        output=message_items([reply], status="incomplete"),
        usage=usage,
        conversation="conv_1",
    )
    response = Response.model_validate(payload)
    assert response.output_text == "Hello there" and response.store is False
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == 4
    assert response.usage.total_tokens == 13 and response.usage.output_tokens_details.reasoning_tokens == 0
    assert usage_object(None)["total_tokens"] == 0


def test_a_tool_calling_answer_is_function_call_items() -> None:
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    items = message_items([Message(role="assistant", content="", tool_calls=[call])])
    assert [i["type"] for i in items] == ["function_call"]
    listed = ResponseItemList.model_validate(
        {"object": "list", "data": items, "first_id": items[0]["id"], "last_id": items[0]["id"], "has_more": False}
    )
    assert listed.data[0].type == "function_call"


def test_gateway_estimates_and_reserves_a_responses_body() -> None:
    body = {
        "instructions": "x" * 40,
        "input": [
            {"role": "user", "content": "y" * 40},
            {"type": "function_call_output", "call_id": "c", "output": "z" * 40},
            None,
            {"content": {"not": "text"}},
        ],
        "max_output_tokens": 9,
    }
    assert estimate_prompt_tokens(body) > estimate_prompt_tokens({"input": []})
    assert estimate_prompt_tokens({"input": "x" * 400}) > estimate_prompt_tokens({"input": "x"})
    assert most_tokens(body, 0, default_max_tokens=100, limit=1000) == 9


EVENT = TypeAdapter(ResponseStreamEvent)


def _parse(pieces: list[bytes]) -> list[dict]:
    """Each SSE event of `pieces`: its `event:` and `id:` lines must match its data."""
    events = []
    for block in b"".join(pieces).decode().split("\n\n")[:-1]:
        kind, sse_id, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}" and sse_id == f"id: {payload['sequence_number']}"
        EVENT.validate_python(payload)
        events.append(payload)
    return events


def _call(
    index: int, *, call_id: str | None = None, name: str | None = None, arguments: str | None = None
) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=call_id, function=FunctionCallDelta(name=name, arguments=arguments))


def test_the_event_builder_numbers_events_and_closes_every_item_in_order() -> None:
    body = _body(tools=[TOOL])
    skeleton = response_object(
        body, response_id="resp_1", created_at=1.0, status="in_progress", output=[], usage=None, conversation=None
    )
    events = ResponseEvents(skeleton)
    pieces = events.opening()
    pieces += events.chunk(TokenChunk(seq=0, text="Let me "))
    pieces += events.chunk(TokenChunk(seq=1, text="check."))
    pieces += events.chunk(TokenChunk(seq=2, tool_calls=[_call(0, call_id="c1", name="get_weather", arguments='{"ci')]))
    pieces += events.chunk(TokenChunk(seq=3, tool_calls=[_call(0, arguments='ty": "Paris"}')]))
    pieces += events.chunk(TokenChunk(seq=4, tool_calls=[_call(1, call_id="c2", name="get_weather")]))
    output = events.output("completed")
    final = response_object(
        body, response_id="resp_1", created_at=1.0, status="completed", output=output, usage=Usage(), conversation=None
    )
    parsed = _parse([*pieces, *events.closing(final)])
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    assert [e["type"] for e in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_item.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    response = Response.model_validate(parsed[-1]["response"])
    assert response.output_text == "Let me check."
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.arguments) for c in calls] == [("c1", '{"city": "Paris"}'), ("c2", "")]
    added = [e["item"]["id"] for e in parsed if e["type"] == "response.output_item.added"]
    assert added == [item.id for item in response.output]  # the ids streamed are the stored ones


@pytest.mark.parametrize(
    ("piece", "end"),
    [
        (b"data: {}\n\ndata: [DONE]\n\n", True),
        (b"event: response.output_text.delta\nid: 4\ndata: {}\n\nevent: response.completed\nid: 5\ndata: {}\n\n", True),
        (b"event: response.incomplete\nid: 9\ndata: {}\n\n", True),
        (b"event: response.failed\nid: 9\ndata: {}\n\n", True),
        (b'event: response.completed\nid: 9\ndata: {"a": ', False),  # cut mid-event
        (b"event: response.completed\nid: 5\ndata: {}\n\nevent: response.output_item.done\nid: 6\ndata: {}\n\n", False),
        (b'event: response.output_text.delta\nid: 4\ndata: {"delta": "event: response.completed"}\n\n', False),
    ],
)
def test_the_gateway_sees_where_a_stream_ends(piece: bytes, end: bool) -> None:
    assert _stream_end(piece) is end


def test_a_chain_keeps_the_recent_history_that_fits_never_starting_with_a_tool_result() -> None:
    call = ToolCall(id="c", function=FunctionCall(name="f", arguments="{}"))
    history = [
        Message(role="user", content="old " * 200),
        Message(role="assistant", content="", tool_calls=[call]),
        Message(role="tool", content="result", tool_call_id="c"),
        Message(role="assistant", content="recent answer"),
    ]
    new = [Message(role="user", content="now")]
    assert fit_history(history, fixed=new, budget_tokens=10_000) == history
    assert fit_history(history, fixed=new, budget_tokens=30) == history[1:]
    kept = fit_history(history, fixed=new, budget_tokens=18)
    assert kept == history[3:]  # the call did not fit, so its result is left out too
    assert fit_history(history, fixed=new, budget_tokens=1) == []


@pytest.mark.parametrize(
    ("chat", "responses"),
    [
        ("messages.3.content", "input"),
        ("max_tokens", "max_output_tokens"),
        ("response_format", "text.format"),
        ("tools.2.function.parameters", "tools[2].parameters"),
        ("tools", "tools"),
        ("tool_choice", "tool_choice"),
        (None, None),
    ],
)
def test_chat_params_are_named_as_the_responses_body_names_them(chat: str | None, responses: str | None) -> None:
    assert response_param(chat) == responses
    error = as_response_error(InvalidRequest(f"{chat} is wrong.", param=chat))
    assert error.param == responses and (chat is None or error.message == f"{responses} is wrong.")


class _DownStore:
    async def finish(self, response_id: str, stored: object) -> bool:
        raise RedisError("Redis is down")


async def test_a_response_that_cannot_be_stored_is_503_not_taken_for_kept() -> None:
    body = _body()
    new = input_messages(body)
    initial = response_object(
        body, response_id="resp_1", created_at=1.0, status="in_progress", output=[], usage=None, conversation=None
    )
    target = Target(
        response_id="resp_1",
        tenant="t",
        initial=initial,
        history=[],
        new=new,
        input_items=message_items(new),
        session=None,
        stored=True,
    )
    service = ResponsesService(
        settings=None,  # type: ignore[arg-type]
        completions=None,  # type: ignore[arg-type]
        catalog=None,  # type: ignore[arg-type]
        sessions=None,  # type: ignore[arg-type]
        store=_DownStore(),  # type: ignore[arg-type]
        chunk_log=None,  # type: ignore[arg-type]
        run_on=RunOn(SimpleNamespace(lease_s=1.0)),  # type: ignore[arg-type]
    )
    response = finished_response(initial, status="completed", output=[], usage=Usage())
    with pytest.raises(Unavailable) as caught:
        await service.keep(target, Message(role="assistant", content="hi"), response, job_id="j", last_seq=0)
    assert caught.value.code == "response_not_stored"


def _chunks() -> list[TokenChunk]:
    return [
        TokenChunk(seq=0, text="Let me "),
        TokenChunk(seq=1, tool_calls=[_call(0, name="get_weather", arguments="{}")]),
        TokenChunk(seq=2, text="see.", finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=2)),
    ]


def test_events_rebuilt_from_the_same_chunks_are_the_same_bytes() -> None:
    body = _body(tools=[TOOL], background=True)
    initial = response_object(
        body, response_id="resp_ab", created_at=1.0, status="queued", output=[], usage=None, conversation=None
    )

    def run() -> tuple[list[bytes], ResponseEvents]:
        events = ResponseEvents(skeleton_of(initial))
        pieces = events.opening()
        for chunk in [*_chunks(), _chunks()[1]]:  # a chunk seen twice adds nothing
            pieces += events.chunk(chunk)
        final = finished_response(initial, status="completed", output=events.output("completed"), usage=events.usage)
        return [*pieces, *events.closing({**final, "completed_at": 2})], events

    first, events = run()
    assert first == run()[0]
    parsed = _parse(first)
    assert parsed[0]["response"]["status"] == "queued" and parsed[1]["response"]["status"] == "in_progress"
    assert parsed[0]["response"]["background"] is True
    final = Response.model_validate(parsed[-1]["response"])
    assert [item.id for item in final.output] == ["msg_ab_0", "fc_ab_1"]
    assert final.output[1].call_id == "call_ab_1"  # type: ignore[union-attr]  # the worker sent none
    assert events.reply().content == "Let me see." and events.reply().tool_calls is not None
    assert events.last_seq == 2 and events.finish_reason == "stop" and events.usage is not None
    assert events.seq == len(parsed)
    quiet = ResponseEvents(skeleton_of(initial), quiet=True)
    assert all(piece == b"" for chunk in _chunks() for piece in quiet.chunk(chunk))
    assert quiet.output("completed") == events.output("completed")


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("stop", "completed"),
        ("tool_calls", "completed"),
        ("length", "incomplete"),
        ("cancelled", "cancelled"),
        ("error", "failed"),
        (None, "completed"),
    ],
)
def test_the_status_of_a_finish_reason(reason: str | None, status: str) -> None:
    assert status_of(reason) == status


def test_a_cancelled_or_failed_stream_ends_with_response_failed() -> None:
    initial = response_object(
        _body(background=True),
        response_id="resp_1",
        created_at=1.0,
        status="queued",
        output=[],
        usage=None,
        conversation=None,
    )
    for status in ("cancelled", "failed"):
        events = ResponseEvents(skeleton_of(initial))
        pieces = [*events.opening(), *events.chunk(TokenChunk(seq=0, text="Hi"))]
        end = finished_response(initial, status=status, output=events.output("incomplete"), usage=None)
        parsed = _parse([*pieces, *events.closing(end)])
        assert parsed[-1]["type"] == "response.failed" and parsed[-1]["response"]["status"] == status


def test_a_text_delta_is_the_bytes_the_generic_event_makes() -> None:
    initial = response_object(
        _body(), response_id="resp_ab", created_at=1.0, status="in_progress", output=[], usage=None, conversation=None
    )
    events = ResponseEvents(skeleton_of(initial))
    events.opening()
    for text in ("Hi", ' "quoted"\n', "é \u2028 \x00 ☃"):
        fast = events.chunk(TokenChunk(seq=events.last_seq + 1, text=text))[-1]
        events.seq -= 1
        generic = events._event(
            "response.output_text.delta",
            item_id="msg_ab_0",
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )
        assert fast == generic


async def test_a_replay_from_any_event_is_the_rest_of_the_whole_replay() -> None:
    body = _body(tools=[TOOL])
    initial = response_object(
        body, response_id="resp_cd", created_at=1.0, status="in_progress", output=[], usage=None, conversation=None
    )
    chunks = [
        *(TokenChunk(seq=i, text=f" w{i}") for i in range(600)),  # more than one page
        TokenChunk(seq=600, tool_calls=[_call(0, call_id="c1", name="get_weather", arguments='{"a"')]),
        TokenChunk(seq=601, tool_calls=[_call(0, arguments=": 1}"), _call(1, call_id="c2", name="get_weather")]),
        TokenChunk(seq=602, finish_reason="stop", usage=Usage()),
    ]
    built = ResponseEvents(skeleton_of(initial), quiet=True)
    for chunk in chunks:
        built.chunk(chunk)
    final = finished_response(initial, status="completed", output=built.output("completed"), usage=None)
    stored = StoredResponse(tenant="t", response=final, input_items=[], context=[], job_id="j", last_seq=602)
    replays = ResponseReplays(settings=None, store=None, chunk_log=None, lease_s=1.0)  # type: ignore[arg-type]

    async def replay(after: int) -> list[dict]:
        pieces = [piece async for piece in replays._events("resp_cd", stored, chunks, after)]
        return _parse(pieces)

    whole = await replay(-1)
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert whole[-1]["type"] == "response.completed" and len(whole) > 600
    for after in (0, 1, 3, 300, 601, 602, 603, 604, len(whole) - 3, len(whole) - 2):
        assert await replay(after) == whole[after + 1 :], after
