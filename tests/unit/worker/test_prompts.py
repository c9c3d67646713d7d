"""services.worker.prompts: tools, tool calls and tool results written into a prompt."""

import json

from services.worker.prompts import tool_prompt_messages
from shared.schemas import FunctionCall, Message, ToolCall
from tests.unit.worker.tool_calls import TIME, WEATHER, auto, parse


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
