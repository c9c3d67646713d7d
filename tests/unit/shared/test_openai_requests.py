"""shared.openai_requests: OpenAI request bodies in, what a job carries out.

The 400s for bad input, through the session manager's route, are in
tests/unit/sessions/test_request_validation.py.
"""

from typing import Any, get_args

import orjson
import pytest

from shared.errors import InvalidRequest
from shared.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
    check_json_schema,
    parse_request,
)
from shared.schemas import Capability, FunctionCall, FunctionSpec, JsonSchemaFormat, Message, NamedToolChoice, ToolCall

LIMITS = RequestLimits(max_choices=8, max_schema_bytes=4096)
WEATHER_PARAMETERS = {
    "properties": {"city": {"title": "City", "type": "string"}, "unit": {"title": "Unit", "type": "string"}},
    "required": ["city", "unit"],
    "type": "object",
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "Weather", "description": "Get the weather for a city.", "parameters": WEATHER_PARAMETERS},
}


def chat(**overrides: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "smollm2", "messages": [{"role": "user", "content": "Hello"}], **overrides}
    request = parse_request("chat", orjson.dumps(body), LIMITS)
    assert isinstance(request, ChatCompletionRequest)
    return request


def completion(**overrides: Any) -> CompletionRequest:
    request = parse_request("completion", orjson.dumps({"model": "m", "prompt": "Once upon", **overrides}), LIMITS)
    assert isinstance(request, CompletionRequest)
    return request


def refusal(kind: str, body: dict[str, Any], limits: RequestLimits = LIMITS) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_request(kind, orjson.dumps(body), limits)  # type: ignore[arg-type]
    return info.value


# Accepted bodies ----------------------------------------------------------------------------


def test_typical_openai_chat_body_is_accepted() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": "Hi", "name": "alice"},
            {"role": "assistant", "content": None},
        ],
        temperature=0,
        top_p=0.9,
        max_tokens=32,
        stop="\n",
        seed=1,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        user="someone",
        presence_penalty=0.0,
    )
    assert [m.to_message() for m in request.messages] == [
        Message(role="system", content="Be brief."),
        Message(role="developer", content="Answer in English."),
        Message(role="user", content="Hi", name="alice"),
        Message(role="assistant", content=""),
    ]
    assert request.stop_list == ["\n"]
    assert request.include_usage
    assert request.requested_max_tokens == 32
    assert request.stream
    assert request.user == "someone"


def test_nulls_mean_the_defaults() -> None:
    """OpenAI's schema makes these nullable; clients send null for "not set"."""
    request = chat(n=None, stream=None, stop=None, logprobs=None, tools=None, tool_choice=None, temperature=None)
    assert request.choices == 1
    assert not request.stream
    assert request.stop_list == []
    assert request.logprob_count is None
    assert request.tool_specs() is None
    assert list(request.capabilities_used()) == []


def test_defaults() -> None:
    request = chat()
    assert request.stop_list == []
    assert not request.include_usage
    assert not request.stream
    assert request.session_id is None
    assert request.choices == 1
    assert request.requested_max_tokens is None


def test_text_content_parts_are_flattened() -> None:
    request = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}]
    )
    assert request.messages[0].to_message() == Message(role="user", content="Hello, world")


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=10, max_completion_tokens=20).requested_max_tokens == 20


def test_n_up_to_the_deployments_limit() -> None:
    assert chat(n=8).choices == 8
    error = refusal("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9})
    assert (error.param, error.code) == ("n", "integer_above_max_value")
    assert "Expected a value <= 8, but got 9" in error.message


def test_a_replayed_tool_conversation_keeps_its_calls() -> None:
    """LangChain's and instructor's history replay: assistant content null (or "") with
    tool_calls, a tool message with tool_call_id (and instructor's extra `name`)."""
    call = {"type": "function", "id": "call_1", "function": {"name": "Weather", "arguments": '{"city": "Paris"}'}}
    request = chat(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "name": "Weather", "content": "18C"},
            {"role": "assistant", "content": "", "tool_calls": [{**call, "id": "call_2"}], "refusal": None},
        ],
        tools=[WEATHER_TOOL],
    )
    messages = [m.to_message() for m in request.messages]
    expected_call = ToolCall(id="call_1", function=FunctionCall(name="Weather", arguments='{"city": "Paris"}'))
    assert messages[1] == Message(role="assistant", content="", tool_calls=[expected_call])
    assert messages[2] == Message(role="tool", content="18C", name="Weather", tool_call_id="call_1")
    assert messages[3].tool_calls is not None and messages[3].tool_calls[0].id == "call_2"


def test_langchain_bind_tools_and_forced_function_bodies() -> None:
    auto = chat(tools=[WEATHER_TOOL])
    assert auto.tool_specs() == [
        FunctionSpec(name="Weather", description="Get the weather for a city.", parameters=WEATHER_PARAMETERS)
    ]
    assert (auto.job_tool_choice(), auto.parallel_calls) == ("auto", True)
    assert list(auto.capabilities_used()) == ["tools"]

    required = chat(tools=[WEATHER_TOOL], tool_choice="required")
    assert required.job_tool_choice() == "required"

    strict_tool = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": True}}
    forced = chat(
        tools=[strict_tool],
        tool_choice={"type": "function", "function": {"name": "Weather"}},
        parallel_tool_calls=False,
    )
    assert forced.job_tool_choice() == NamedToolChoice(name="Weather")
    assert forced.parallel_calls is False
    specs = forced.tool_specs()
    assert specs is not None and specs[0].strict is True


def test_tool_choice_none_sends_no_tools() -> None:
    request = chat(tools=[WEATHER_TOOL], tool_choice="none")
    assert request.tool_specs() is None
    assert list(request.capabilities_used()) == []


def test_structured_output_bodies() -> None:
    """LangChain's with_structured_output (strict json_schema), instructor's JSON_SCHEMA (no
    strict) and json_mode."""
    schema = {**WEATHER_PARAMETERS, "title": "Weather", "description": "Get the weather for a city."}
    strict = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "Weather", "schema": schema, "strict": True}}
    )
    wire = strict.job_response_format()
    assert wire is not None and wire.type == "json_schema"
    assert wire.json_schema == JsonSchemaFormat(name="Weather", schema_=schema, strict=True)
    assert list(strict.capabilities_used()) == ["response_format"]

    loose = chat(response_format={"type": "json_schema", "json_schema": {"name": "Weather", "schema": schema}})
    assert loose.job_response_format() is not None

    json_mode = chat(response_format={"type": "json_object"})
    wire = json_mode.job_response_format()
    assert wire is not None and (wire.type, wire.json_schema) == ("json_object", None)

    text = chat(response_format={"type": "text"})
    assert text.job_response_format() is None
    assert list(text.capabilities_used()) == []


def test_every_sampling_parameter_reaches_the_job() -> None:
    request = chat(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={"42": -100, "7": 5.5},
        stop=["a", "b"],
        seed=-3,
        min_tokens=2,
        ignore_eos=True,
    )
    sampling = request.sampling(max_tokens=20)
    assert sampling.model_dump() == {
        "max_tokens": 20,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {42: -100.0, 7: 5.5},
        "stop": ["a", "b"],
        "seed": -3,
        "min_tokens": 2,
        "ignore_eos": True,
    }
    # Each sampling parameter is a capability of its own, in the order they are declared.
    not_sampling = {"tools", "response_format", "logprobs", "echo"}
    assert list(request.capabilities_used()) == [c for c in get_args(Capability) if c not in not_sampling]


def test_unset_sampling_leaves_the_models_defaults() -> None:
    sampling = chat().sampling(max_tokens=5)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty) == (None,) * 4
    assert (sampling.presence_penalty, sampling.logit_bias, sampling.seed) == (0.0, {}, None)


def test_default_valued_parameters_need_no_capability() -> None:
    request = chat(
        presence_penalty=0, frequency_penalty=0, repetition_penalty=1, logit_bias={}, top_k=-1, min_p=0, stop=[]
    )
    assert list(request.capabilities_used()) == []


def test_logprobs() -> None:
    assert chat(logprobs=True).logprob_count == 0
    request = chat(logprobs=True, top_logprobs=20)
    assert request.logprob_count == 20
    assert list(request.capabilities_used()) == ["logprobs"]
    assert chat(logprobs=False).logprob_count is None


def test_known_openai_fields_holding_no_op_values_are_accepted() -> None:
    request = chat(store=False, metadata={}, service_tier="auto", modalities=["text"], audio=None, verbosity=None)
    assert request.model == "smollm2"
    assert completion(best_of=1).prompt_text == "Once upon"
    assert completion(best_of=3, n=3).choices == 3
    assert completion(suffix="").prompt_text == "Once upon"


# Completions --------------------------------------------------------------------------------


def test_completion_with_a_string_or_a_list_of_one_prompt() -> None:
    assert completion(max_tokens=5).requested_max_tokens == 5
    assert completion(prompt=["Once upon"]).prompt_text == "Once upon"


def test_completion_logprobs_and_echo() -> None:
    request = completion(logprobs=3, echo=True)
    assert request.logprob_count == 3
    assert list(request.capabilities_used()) == ["logprobs", "echo"]
    assert completion(logprobs=0).logprob_count == 0
    assert list(completion(echo=False).capabilities_used()) == []


# Schemas ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dialect",
    [
        "http://json-schema.org/draft-07/schema#",
        "http://json-schema.org/draft-04/schema#",
        "https://json-schema.org/draft/2020-12/schema",
    ],
)
def test_schemas_of_known_dialects_are_accepted(dialect: str) -> None:
    schema = {"$schema": dialect, "type": "object", "properties": {"a": {"type": "integer"}}}
    assert check_json_schema(schema, "response_format", 4096) == len(orjson.dumps(schema))


def test_a_schema_naming_an_unknown_dialect_is_refused_without_fetching_it() -> None:
    with pytest.raises(InvalidRequest) as info:
        check_json_schema({"$schema": "http://127.0.0.1:9/meta", "type": "object"}, "response_format", 4096)
    assert info.value.param == "response_format"
    assert "$schema" in info.value.message


def test_a_schema_over_the_size_limit_is_refused() -> None:
    schema = {"type": "object", "description": "x" * 5000}
    with pytest.raises(InvalidRequest) as info:
        check_json_schema(schema, "tools.0.function.parameters", 4096)
    assert info.value.param == "tools.0.function.parameters"
    assert "4096" in info.value.message


def test_tool_schemas_count_together_against_the_limit() -> None:
    def tool(i: int) -> dict[str, Any]:
        return {"type": "function", "function": {"name": f"f{i}", "parameters": {"description": "x" * 1500}}}

    chat(tools=[tool(0), tool(1)])
    error = refusal(
        "chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool(i) for i in range(3)]}
    )
    assert error.param == "tools"
