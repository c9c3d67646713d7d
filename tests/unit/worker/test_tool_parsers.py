"""services.worker.tool_parsers: the three tool-call parsers (cut anywhere, resumed anywhere), the
answer's finish reason, call ids and merged deltas."""

import random
import re
from collections.abc import Callable

import pytest

from services.worker.engines.base import ToolCallParser
from services.worker.tool_parsers import (
    AutoCallsParser,
    NamedCallParser,
    RequiredCallsParser,
    answer_finish_reason,
    merge_deltas,
    parser_for,
    tool_call_id,
)
from shared.schemas import FunctionCallDelta, NamedToolChoice, ToolCallDelta
from tests.unit.worker.tool_calls import WEATHER, Answer, auto, job, parse


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


def cut(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


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
