"""services.worker.tools: guides from a job, the three tool-call parsers (cut anywhere, resumed
anywhere), and tools written into a prompt."""

import itertools
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest

from services.worker.engines.base import Guide, InvalidPrompt, ToolCallParser
from services.worker.tools import (
    AutoCallsParser,
    NamedCallParser,
    RequiredCallsParser,
    answer_finish_reason,
    guide_for,
    merge_deltas,
    parser_for,
    tool_call_id,
    tool_prompt_messages,
)
from shared.schemas import (
    FunctionCall,
    FunctionCallDelta,
    FunctionSpec,
    Job,
    JsonSchemaFormat,
    Message,
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
    ToolCallDelta,
)

WEATHER = FunctionSpec(
    name="get_weather",
    description="The weather in a city.",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"],
        "$defs": {"Unit": {"enum": ["c", "f"]}},
    },
)
TIME = FunctionSpec(name="get_time", parameters=None)


def job(**fields: Any) -> Job:
    return Job(job_id="job-1", model="m", channel="c", deadline=time.time() + 60, messages=[], **fields)


# --- guides ------------------------------------------------------------------------------------


def test_a_job_without_tools_or_format_is_free_text() -> None:
    assert guide_for(job()) is None
    assert guide_for(job(response_format=ResponseFormat(type="text"))) is None
    assert guide_for(job(tools=[WEATHER])) is None  # auto: the text is parsed, not constrained


def test_response_formats_become_guides() -> None:
    assert guide_for(job(response_format=ResponseFormat(type="json_object"))) == Guide("json_object")
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    fmt = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="x", schema=schema))
    guide = guide_for(job(response_format=fmt))
    assert guide is not None and guide.kind == "json_schema" and guide.schema is not None
    assert json.loads(guide.schema) == schema
    assert list(json.loads(guide.schema)["properties"]) == ["b", "a"]  # the order answers follow


def test_a_json_schema_format_without_its_schema_is_refused() -> None:
    with pytest.raises(InvalidPrompt):
        guide_for(job(response_format=ResponseFormat(type="json_schema")))


def guided_schema(**fields: Any) -> dict[str, Any]:
    guide = guide_for(job(**fields))
    assert guide is not None and guide.kind == "json_schema" and guide.schema is not None
    schema: dict[str, Any] = json.loads(guide.schema)
    return schema


def test_required_is_an_array_of_calls_of_the_tools_with_their_defs_at_the_top() -> None:
    fmt = ResponseFormat(type="json_object")
    schema = guided_schema(tools=[WEATHER, TIME], tool_choice="required", response_format=fmt)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"Unit": {"enum": ["c", "f"]}}
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [
        {"type": "string", "enum": ["get_weather"]},
        {"type": "string", "enum": ["get_time"]},
    ]
    assert "$defs" not in branches[0]["properties"]["parameters"]
    assert branches[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    validator = jsonschema.Draft202012Validator(schema)
    two = [
        {"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}},
        {"name": "get_time", "parameters": {}},
    ]
    assert validator.is_valid(two)
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "k"}}])
    assert not validator.is_valid([{"name": "nope", "parameters": {}}])
    assert not validator.is_valid([])


def test_required_without_parallel_calls_allows_one_call() -> None:
    schema = guided_schema(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert schema["maxItems"] == 1
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "get_time", "parameters": {}}])
    assert not validator.is_valid([{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}])


def test_tools_defining_one_def_differently_are_refused() -> None:
    other = FunctionSpec(name="other", parameters={"type": "object", "$defs": {"Unit": {"type": "string"}}})
    with pytest.raises(InvalidPrompt, match=r"\$defs\.Unit"):
        guide_for(job(tools=[WEATHER, other], tool_choice="required"))
    same = FunctionSpec(name="same", parameters={"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}}})
    assert guide_for(job(tools=[WEATHER, same], tool_choice="required")) is not None


def test_a_named_tool_is_constrained_to_its_parameters() -> None:
    assert guided_schema(tools=[WEATHER, TIME], tool_choice=NamedToolChoice(name="get_weather")) == WEATHER.parameters
    assert guided_schema(tools=[WEATHER, TIME], tool_choice=NamedToolChoice(name="get_time")) == {
        "type": "object",
        "properties": {},
    }
    with pytest.raises(InvalidPrompt, match="nope"):
        guide_for(job(tools=[WEATHER], tool_choice=NamedToolChoice(name="nope")))


def test_finish_reason_is_tool_calls_unless_the_call_was_forced_by_name() -> None:
    auto, required = job(tools=[WEATHER]), job(tools=[WEATHER], tool_choice="required")
    named = job(tools=[WEATHER], tool_choice=NamedToolChoice(name="get_weather"))
    assert answer_finish_reason(auto, "stop", True) == "tool_calls"
    assert answer_finish_reason(required, "stop", True) == "tool_calls"
    assert answer_finish_reason(named, "stop", True) == "stop"
    assert answer_finish_reason(auto, "stop", False) == "stop"
    assert answer_finish_reason(auto, "length", True) == "length"


def test_parser_for_follows_tool_choice() -> None:
    assert parser_for(job()) is None
    assert isinstance(parser_for(job(tools=[WEATHER])), AutoCallsParser)
    assert isinstance(parser_for(job(tools=[WEATHER], tool_choice="required")), RequiredCallsParser)
    assert isinstance(parser_for(job(tools=[WEATHER], tool_choice=NamedToolChoice(name="x"))), NamedCallParser)


def test_call_ids_are_openai_shaped_and_derive_from_the_job_and_index() -> None:
    ids = {tool_call_id(j, i) for j in ("a", "b") for i in range(3)}
    assert len(ids) == 6
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert tool_call_id("a", 1) == tool_call_id("a", 1)


def test_adjacent_deltas_of_one_call_merge() -> None:
    opening = ToolCallDelta(index=0, id="call_x", type="function", function=FunctionCallDelta(name="f", arguments=""))
    piece = ToolCallDelta(index=0, function=FunctionCallDelta(arguments='{"a"'))
    second = ToolCallDelta(index=1, id="call_y", type="function", function=FunctionCallDelta(name="g"))
    merged = merge_deltas(
        [opening, piece, ToolCallDelta(index=0, function=FunctionCallDelta(arguments=": 1}")), second]
    )
    assert merged == [
        ToolCallDelta(
            index=0, id="call_x", type="function", function=FunctionCallDelta(name="f", arguments='{"a": 1}')
        ),
        second,
    ]


# --- parsers -----------------------------------------------------------------------------------


@dataclass
class Answer:
    """What a parser made of a text: its content and its calls as a client assembles them."""

    content: str = ""
    calls: dict[int, dict[str, str]] = field(default_factory=dict)

    def take(self, content: str, deltas: list[ToolCallDelta]) -> None:
        self.content += content
        indexes = [d.index for d in deltas]
        assert all(a != b for a, b in itertools.pairwise(indexes)), "one delta per call in a row"
        for delta in deltas:
            function = delta.function or FunctionCallDelta()
            if delta.index not in self.calls:
                # The first delta of a call carries its id, type and name.
                assert delta.id == tool_call_id("job-1", delta.index) and delta.type == "function"
                assert function.name
                self.calls[delta.index] = {"id": delta.id, "name": function.name, "arguments": ""}
            else:
                assert delta.id is None and function.name is None
            self.calls[delta.index]["arguments"] += function.arguments or ""

    def call_list(self) -> list[tuple[str, Any]]:
        return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(self.calls.items())]


def cut(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def parse(make: Callable[[], ToolCallParser], text: str, pieces: list[str] | None = None) -> Answer:
    parser, answer = make(), Answer()
    for piece in pieces if pieces is not None else [text]:
        answer.take(*parser.feed(piece))
    answer.take(*parser.finish())
    return answer


def assert_cut_and_resume_proof(make: Callable[[], ToolCallParser], text: str) -> Answer:
    """The answer is the same however the text is cut, and when a parser that replayed any
    prefix (a resumed job's) goes on from there after another one published that prefix."""
    whole = parse(make, text)
    rng = random.Random(text)
    for _ in range(30):
        assert parse(make, text, cut(text, rng)) == whole
    for stop in range(len(text) + 1):
        first, answer = make(), Answer()
        for piece in cut(text[:stop], rng):
            answer.take(*first.feed(piece))
        resumed = make()
        resumed.feed(text[:stop])  # the replay publishes nothing
        for piece in cut(text[stop:], rng):
            answer.take(*resumed.feed(piece))
        answer.take(*resumed.finish())
        assert answer == whole, f"resumed at {stop}"
    return whole


def auto(single: bool = False) -> Callable[[], ToolCallParser]:
    return lambda: AutoCallsParser("job-1", single=single)


def required(single: bool = False) -> Callable[[], ToolCallParser]:
    return lambda: RequiredCallsParser("job-1", single=single)


def named() -> ToolCallParser:
    return NamedCallParser("job-1", "get_weather")


@pytest.mark.parametrize(
    "text",
    ["Just an answer, <b>bold</b> and a < b, <tool_cal not a tag.\n", "", "ends with a partial <tool_c", "  spaced  "],
)
def test_auto_text_without_calls_is_all_content(text: str) -> None:
    assert assert_cut_and_resume_proof(auto(), text) == Answer(content=text)


def test_auto_calls_are_parsed_and_the_whitespace_around_them_dropped() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Pa\\"ris <tool_call>", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>[{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}, {"name": "x", "parameters": {}}]'
        "</tool_call>\n"
    )
    answer = assert_cut_and_resume_proof(auto(), text)
    assert answer.content == "Let me check."
    assert answer.call_list() == [
        ("get_weather", {"city": 'Pa"ris <tool_call>', "unit": "c"}),
        ("get_time", {"tz": "UTC"}),
        ("x", {}),
    ]


def test_auto_without_parallel_calls_keeps_the_first() -> None:
    text = (
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]</tool_call>'
        '<tool_call>{"name": "c", "arguments": {}}</tool_call>'
    )
    assert [name for name, _ in assert_cut_and_resume_proof(auto(single=True), text).call_list()] == ["a"]


def test_auto_text_between_calls_is_content() -> None:
    text = '<tool_call>{"name": "a", "arguments": {"n": 1}}</tool_call>\nand then\n<tool_call>{"name": "b"}</tool_call>'
    answer = assert_cut_and_resume_proof(auto(), text)
    assert answer.content == "\nand then"
    assert answer.call_list() == [("a", {"n": 1}), ("b", {})]


def test_auto_an_unclosed_tag_is_a_call_if_it_parses() -> None:
    answer = assert_cut_and_resume_proof(auto(), 'Ok <tool_call>{"name": "a", "arguments": {"n": 1}}')
    assert (answer.content, answer.call_list()) == ("Ok", [("a", {"n": 1})])


@pytest.mark.parametrize(
    "text",
    [
        'Hm.\n<tool_call>{"name": "a", "arguments": {"n": 1}</tool_call> more',  # broken JSON
        "Hm.\n<tool_call>not json",  # unclosed, broken
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
    ],
)
def test_auto_an_unparseable_call_falls_back_to_content(text: str) -> None:
    assert assert_cut_and_resume_proof(auto(), text) == Answer(content=text)


def test_auto_calls_before_an_unparseable_tag_stand() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>oops</tool_call>'
    answer = assert_cut_and_resume_proof(auto(), text)
    assert answer.call_list() == [("a", {})]
    assert answer.content == "\n<tool_call>oops</tool_call>"


def test_required_calls_stream_as_their_parameters_are_read() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"city": "a]b}\\"c", "unit": "c", "n": [1, {"x": null}]}},'
        ' {"parameters": {"tz": "UTC"}, "name": "get_time"}, {"name": "noparams"}, {"name": "n", "parameters": 7}]'
    )
    answer = assert_cut_and_resume_proof(required(), text)
    assert answer.content == ""
    assert answer.call_list() == [
        ("get_weather", {"city": 'a]b}"c', "unit": "c", "n": [1, {"x": None}]}),
        ("get_time", {"tz": "UTC"}),
        ("noparams", {}),
        ("n", 7),
    ]
    # The arguments are the parameters' text exactly as generated.
    assert answer.calls[0]["arguments"] == '{"city": "a]b}\\"c", "unit": "c", "n": [1, {"x": null}]}'


def test_required_arguments_stream_before_the_call_ends() -> None:
    parser = RequiredCallsParser("job-1", single=False)
    answer = Answer()
    answer.take(*parser.feed('[{"name": "get_weather", "parameters": {"city": "Pa'))
    assert answer.calls[0] == {"id": tool_call_id("job-1", 0), "name": "get_weather", "arguments": '{"city": "Pa'}


def test_required_without_parallel_calls_keeps_the_first() -> None:
    text = '[{"name": "a", "parameters": {"n": 1}}, {"name": "b", "parameters": {}}]'
    assert assert_cut_and_resume_proof(required(single=True), text).call_list() == [("a", {"n": 1})]


def test_required_text_with_no_call_is_content_at_the_end() -> None:
    assert assert_cut_and_resume_proof(required(), "I would rather not.") == Answer(content="I would rather not.")


def test_named_the_whole_answer_is_the_arguments() -> None:
    answer = assert_cut_and_resume_proof(named, '  \n{"city": "Paris", "unit": "c"}')
    assert answer.content == ""
    assert answer.call_list() == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert parse(named, "") == Answer()


# --- tools in a prompt -------------------------------------------------------------------------


def test_tools_join_the_system_message_and_calls_and_results_become_text() -> None:
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris", "unit": "c"}'))
    messages = [
        Message(role="developer", content="Be brief."),
        Message(role="user", content="Weather in Paris and the time?"),
        Message(role="assistant", content="", tool_calls=[call, call.model_copy(update={"id": "call_2"})]),
        Message(role="tool", content="18C", tool_call_id="call_1"),
        Message(role="tool", content="19C", tool_call_id="call_2", name="get_weather"),
        Message(role="assistant", content="It is 18C."),
    ]
    turns = tool_prompt_messages(messages, [WEATHER, TIME])
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user", "assistant"]
    system = turns[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n\n")
    tool_lines = system.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in tool_lines] == [
        {"type": "function", "function": WEATHER.model_dump(exclude_none=True, exclude={"strict"})},
        {"type": "function", "function": {"name": "get_time"}},
    ]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert turns[3]["content"] == "<tool_response>\n18C\n</tool_response>\n<tool_response>\n19C\n</tool_response>"
    # What the prompt shows as a call, the auto parser reads back as that call.
    replayed = parse(auto(), turns[2]["content"])
    assert replayed.call_list() == [("get_weather", {"city": "Paris", "unit": "c"})] * 2


def test_without_a_system_message_the_tools_get_a_default_one() -> None:
    turns = tool_prompt_messages([Message(role="user", content="hi")], [TIME], default_system="You are Axon.")
    assert turns[0]["role"] == "system" and turns[0]["content"].startswith("You are Axon.\n\n# Tools")
    assert turns[1] == {"role": "user", "content": "hi"}


def test_without_tools_plain_messages_pass_through() -> None:
    messages = [Message(role="system", content="s"), Message(role="user", content="u")]
    assert tool_prompt_messages(messages, None) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
    ]


def test_arguments_that_are_not_json_are_shown_as_a_json_string() -> None:
    call = ToolCall(id="c", function=FunctionCall(name="f", arguments="not json"))
    turns = tool_prompt_messages([Message(role="assistant", content="Sure.", tool_calls=[call])], None)
    assert turns == [
        {"role": "assistant", "content": 'Sure.\n<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>'}
    ]
