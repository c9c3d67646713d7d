"""The whole Chat Completions contract against the simulator, as real clients use it (issue 21).

The official `openai` SDK (tools streamed and not, `parse` with a pydantic model, logprobs, `n`,
seeds), instructor (TOOLS and JSON_SCHEMA modes) and LangChain (`bind_tools`,
`with_structured_output`; and on the Responses API, `use_responses_api=True`: invoke, stream, a
tool round trip, structured output, turns chained by `use_previous_response_id`) each get what
they asked for, through all three services; tool calls
round-trip through a conversation and a session's history; bad input is refused with 400 naming
its parameter; a `json_schema` stream survives a worker's kill -9 with identical text. Every answer,
chunk and error body these clients receive is checked against OpenAI's own schemas on the way
(`tests/contract/transport.py`).
"""

import json
from typing import Any, Literal

import httpx
import instructor
import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.runnables import Runnable
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel, Field

from services.cli.launcher import Service
from tests.contract.transport import ContractTransport
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import Stack
from tests.e2e.test_workers import holder, metric, sim_worker, wait_listed

pytestmark = pytest.mark.e2e

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMETERS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    """The weather in a city."""

    city: str
    unit: Literal["c", "f"]
    days: int = Field(ge=1, le=14)
    notes: list[str]


def openai_client(gateway: Service, api_key: str, checked: ContractTransport) -> OpenAI:
    http = httpx.Client(transport=checked, timeout=60)
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, http_client=http)


@pytest.fixture(scope="module")
def sdk(gateway: Service, api_key: str, checked: ContractTransport) -> OpenAI:
    return openai_client(gateway, api_key, checked)


def schema_request(model: str, messages: list[dict], name: str, schema: dict, **fields: Any) -> dict:
    """A chat request whose answer must follow `schema` (`response_format` `json_schema`)."""
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    return {"model": model, "messages": messages, "response_format": response_format, **fields}


def assert_valid_call(call: Any, *, name: str | None = None) -> dict:
    """A complete tool call of one of TOOLS, its arguments a JSON text valid against its schema;
    returns the arguments."""
    assert call.type == "function" and call.id
    assert call.function.name in PARAMETERS
    if name is not None:
        assert call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return arguments


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def test_models_retrieve_gives_one_model_and_an_unknown_one_is_404(sdk: OpenAI) -> None:
    assert SIM_MODEL in [m.id for m in sdk.models.list()]
    model = sdk.models.retrieve(SIM_MODEL)
    assert model.id == SIM_MODEL and model.object == "model"
    # Axon's additions: the context its workers have and the parameters they all honour.
    extra = model.model_extra or {}
    assert extra["context_length"] > 0
    assert {"tools", "response_format", "logprobs", "seed"} <= set(extra["capabilities"])
    assert "presence_penalty" not in extra["capabilities"]  # the simulator refuses it (below)
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


# ---------------------------------------------------------------------------------------------
# Tools with the SDK
# ---------------------------------------------------------------------------------------------


def test_required_tool_choice_answers_with_calls_and_finish_reason_tool_calls(sdk: OpenAI) -> None:
    answer = sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=1)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid_call(call)
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)
    assert not choice.message.content


def test_parallel_tool_calls_false_gives_exactly_one_call(sdk: OpenAI) -> None:
    for seed in range(4):
        answer = sdk.chat.completions.create(
            model=SIM_MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed
        )
        assert len(answer.choices[0].message.tool_calls) == 1
        assert_valid_call(answer.choices[0].message.tool_calls[0])


def test_a_call_forced_by_name_is_that_function_and_ends_stop(sdk: OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, tools=TOOLS, tool_choice=named, seed=2)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's: a named call is not the model's choice
    [call] = choice.message.tool_calls
    assert_valid_call(call, name="get_time")


def test_tool_choice_none_answers_in_text(sdk: OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model=SIM_MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=6, seed=3
    )
    choice = answer.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.finish_reason == "length"


def test_streamed_tool_calls_come_in_openais_shape_and_equal_the_whole_answer(sdk: OpenAI) -> None:
    request = {"model": SIM_MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": 5}
    whole = sdk.chat.completions.create(**request).choices[0].message.tool_calls
    deltas: dict[int, list[Any]] = {}
    finishes = []
    for chunk in sdk.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                deltas.setdefault(delta.index, []).append(delta)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"]
    assert sorted(deltas) == list(range(len(whole)))
    for index, pieces in deltas.items():
        first, rest = pieces[0], pieces[1:]
        # The first piece of a call names it; the arguments follow in pieces, without id or name.
        assert first.id and first.type == "function" and first.function.name == whole[index].function.name
        assert rest, "the arguments came in one piece"
        assert all(p.id is None and (p.function.name is None) and p.function.arguments for p in rest)
        arguments = "".join(p.function.arguments or "" for p in pieces)
        assert json.loads(arguments) == json.loads(whole[index].function.arguments)
    assert len({pieces[0].id for pieces in deltas.values()}) == len(deltas)


def test_the_sdk_stream_helper_reassembles_parsed_tool_calls(sdk: OpenAI) -> None:
    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str
        unit: Literal["c", "f"]

    tool = openai.pydantic_function_tool(GetWeather)
    with sdk.chat.completions.stream(
        model=SIM_MODEL, messages=ASK, tools=[tool], tool_choice="required", parallel_tool_calls=False, seed=6
    ) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


# ---------------------------------------------------------------------------------------------
# Structured outputs with the SDK
# ---------------------------------------------------------------------------------------------


def test_parse_with_a_pydantic_model_gives_a_parsed_object(sdk: OpenAI) -> None:
    answer = sdk.chat.completions.parse(model=SIM_MODEL, messages=ASK, response_format=Weather, seed=7)
    message = answer.choices[0].message
    assert isinstance(message.parsed, Weather)
    assert Weather.model_validate_json(message.content) == message.parsed
    assert message.refusal is None and answer.choices[0].finish_reason == "stop"


def test_json_object_answers_one_json_object(sdk: OpenAI) -> None:
    for seed in range(3):
        answer = sdk.chat.completions.create(
            model=SIM_MODEL, messages=ASK, response_format={"type": "json_object"}, seed=seed, max_tokens=200
        )
        assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_a_streamed_json_schema_answer_is_the_whole_answer_in_pieces(sdk: OpenAI) -> None:
    schema = Weather.model_json_schema()
    request = schema_request(SIM_MODEL, ASK, "weather", schema, seed=8)
    whole = sdk.chat.completions.create(**request).choices[0].message.content
    pieces = [
        c.choices[0].delta.content or "" for c in sdk.chat.completions.create(**request, stream=True) if c.choices
    ]
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), schema)


# ---------------------------------------------------------------------------------------------
# Logprobs, n, seed
# ---------------------------------------------------------------------------------------------


def test_logprobs_with_top_logprobs_one_entry_per_token(sdk: OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model=SIM_MODEL, messages=ASK, max_tokens=6, seed=9, logprobs=True, top_logprobs=3
    )
    choice = answer.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == answer.usage.completion_tokens == 6
    assert "".join(e.token for e in entries) == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob >= values[-1]
        assert bytes(entry.bytes).decode() == entry.token
    plain = sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, max_tokens=6, seed=9, logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * 6
    without = sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, max_tokens=6, seed=9)
    assert without.choices[0].logprobs is None


def test_streamed_logprobs_follow_the_text(sdk: OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=SIM_MODEL, messages=ASK, max_tokens=8, seed=10, logprobs=True, top_logprobs=2, stream=True
    )
    text, tokens = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            tokens += [e.token for e in (choice.logprobs.content if choice.logprobs else None) or []]
    assert len(tokens) == 8 and "".join(tokens) == text


def test_completions_logprobs_and_echo(sdk: OpenAI) -> None:
    prompt = "Once upon a time"
    answer = sdk.completions.create(model=SIM_MODEL, prompt=prompt, max_tokens=5, seed=11, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.tokens) == 5
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)  # the sampled token's plus up to 2
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    echoed = sdk.completions.create(model=SIM_MODEL, prompt=prompt, max_tokens=5, seed=11, echo=True)
    assert echoed.choices[0].text == prompt + answer.choices[0].text


def test_n_choices_are_independent_with_seed_plus_index(sdk: OpenAI) -> None:
    answer = sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, n=3, seed=20, max_tokens=8)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for index, choice in enumerate(answer.choices):
        alone = sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, seed=20 + index, max_tokens=8)
        assert choice.message.content == alone.choices[0].message.content
    assert len({c.message.content for c in answer.choices}) == 3
    assert answer.usage.completion_tokens == 24


def test_n_choices_stream_with_their_index(sdk: OpenAI) -> None:
    whole = sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, n=3, seed=21, max_tokens=8)
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    usage = None
    stream = sdk.chat.completions.create(
        model=SIM_MODEL, messages=ASK, n=3, seed=21, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert usage is not None and usage.completion_tokens == 24


def test_the_same_seed_gives_the_same_text_at_temperature_1(sdk: OpenAI) -> None:
    def ask(seed: int) -> str:
        answer = sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, seed=seed, temperature=1, max_tokens=12)
        return answer.choices[0].message.content

    assert ask(30) == ask(30)
    assert ask(30) != ask(31)


# ---------------------------------------------------------------------------------------------
# instructor and LangChain
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_extracts_a_pydantic_model(sdk: OpenAI, mode: instructor.Mode) -> None:
    client = instructor.from_openai(sdk, mode=mode)
    weather = client.chat.completions.create(
        model=SIM_MODEL, messages=ASK, response_model=Weather, max_retries=1, seed=12
    )
    assert isinstance(weather, Weather)


def langchain_model(
    gateway: Service, api_key: str, checked: ContractTransport, *, seed: int | None = 13, **fields: Any
) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{gateway.url}/v1",
        api_key=api_key,
        model=SIM_MODEL,
        max_retries=0,
        seed=seed,
        http_client=httpx.Client(transport=checked, timeout=60),
        **fields,
    )


def test_langchain_bind_tools_gets_tool_calls(gateway: Service, api_key: str, checked: ContractTransport) -> None:
    model = langchain_model(gateway, api_key, checked).bind_tools([Weather], tool_choice="any")
    message = model.invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(message.tool_calls[0]["args"])


def test_langchain_bind_tools_auto_parses_the_models_own_calls(
    gateway: Service, api_key: str, checked: ContractTransport
) -> None:
    model = langchain_model(gateway, api_key, checked).bind_tools([Weather])
    message = model.invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "Weather"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_gives_an_instance(
    gateway: Service, api_key: str, checked: ContractTransport, method: str
) -> None:
    model = langchain_model(gateway, api_key, checked).with_structured_output(Weather, method=method)
    assert isinstance(model.invoke("What is the weather in Paris?"), Weather)


# ---------------------------------------------------------------------------------------------
# LangChain on the Responses API
# ---------------------------------------------------------------------------------------------


def responses_model(gateway: Service, api_key: str, checked: ContractTransport, **fields: Any) -> ChatOpenAI:
    """`ChatOpenAI(use_responses_api=True)`; without a seed, which the Responses API does not take
    (the simulator answers a prompt the same without one)."""
    return langchain_model(gateway, api_key, checked, seed=None, use_responses_api=True, **fields)


def test_langchain_responses_invoke_and_stream_give_the_same_answer(
    gateway: Service, api_key: str, checked: ContractTransport
) -> None:
    model = responses_model(gateway, api_key, checked, max_tokens=6)
    message = model.invoke("Tell me a story.")
    assert message.response_metadata["id"].startswith("resp_")
    assert message.response_metadata["status"] == "incomplete"
    assert len(message.text.split()) == 6 and message.usage_metadata["output_tokens"] == 6
    chunks = list(model.stream("Tell me a story."))
    # Streamed as they came: a delta per chunk, and a worker under load may put several tokens in one.
    assert 1 < len([c for c in chunks if c.text]) <= 6
    streamed = sum(chunks[1:], chunks[0])
    assert streamed.text == message.text
    assert streamed.usage_metadata == message.usage_metadata
    assert streamed.response_metadata["id"].startswith("resp_")
    assert streamed.response_metadata["id"] != message.response_metadata["id"]
    assert checked.checked["ResponseStreamEvent"] > 6


def test_langchain_responses_tool_call_round_trip(gateway: Service, api_key: str, checked: ContractTransport) -> None:
    """An agent's loop: the model calls a tool, and its result goes back with the whole history,
    or alone chained to the call by `previous_response_id`."""
    model = responses_model(gateway, api_key, checked).bind_tools([WEATHER])
    chained = responses_model(gateway, api_key, checked, use_previous_response_id=True).bind_tools([WEATHER])
    question = HumanMessage("What is the weather in Paris?")
    asked = model.invoke([question])
    [call] = asked.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER_PARAMETERS)

    def answer(client: Runnable, result: str) -> AIMessage:
        return client.invoke([question, asked, ToolMessage(result, tool_call_id=call["id"])], max_tokens=6)

    answered = answer(model, '{"temperature": 18}')
    assert answered.text and not answered.tool_calls
    assert answer(chained, '{"temperature": 18}').text == answered.text  # the same prompt, rebuilt by Axon
    # The tool's result is part of the prompt: another result, another answer.
    assert answer(model, '{"temperature": -40}').text != answered.text


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_responses_structured_output_gives_an_instance(
    gateway: Service, api_key: str, checked: ContractTransport, method: str
) -> None:
    model = responses_model(gateway, api_key, checked).with_structured_output(Weather, method=method, include_raw=True)
    result = model.invoke("What is the weather in Paris?")
    assert result["parsing_error"] is None and isinstance(result["parsed"], Weather)
    assert result["raw"].response_metadata["id"].startswith("resp_")


def test_langchain_responses_chain_turns_with_previous_response_id(
    gateway: Service, api_key: str, checked: ContractTransport, sdk: OpenAI
) -> None:
    chained = responses_model(gateway, api_key, checked, max_tokens=4, use_previous_response_id=True)
    history: list[BaseMessage] = [HumanMessage("Name a colour.")]
    first = chained.invoke(history)
    history += [first, HumanMessage("And another?")]
    second = chained.invoke(history)
    stored = sdk.responses.retrieve(second.response_metadata["id"])
    assert stored.previous_response_id == first.response_metadata["id"]
    # Only the new turn was sent; Axon put the first turn before it.
    assert [i.content[0].text for i in sdk.responses.input_items.list(stored.id).data] == ["And another?"]
    whole = responses_model(gateway, api_key, checked, max_tokens=4).invoke(history)
    assert second.text == whole.text
    assert second.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"]


# ---------------------------------------------------------------------------------------------
# Tool calls in a conversation and in a session
# ---------------------------------------------------------------------------------------------


def tool_turns(call: Any) -> list[dict]:
    """The assistant's call and its result, as a client sends them back."""
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": '{"temperature": 18}'},
    ]


def test_a_conversation_with_a_tool_call_and_its_result_round_trips(sdk: OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, tools=TOOLS, tool_choice=named, seed=14)
    [call] = first.choices[0].message.tool_calls
    history = [*ASK, *tool_turns(call)]
    answer = sdk.chat.completions.create(
        model=SIM_MODEL, messages=history, tools=TOOLS, tool_choice="none", seed=15, max_tokens=6
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"
    # The tool's result is part of the prompt: another result, another answer.
    other = [*history[:-1], {**history[-1], "content": '{"temperature": -40}'}]
    changed = sdk.chat.completions.create(
        model=SIM_MODEL, messages=other, tools=TOOLS, tool_choice="none", seed=15, max_tokens=6
    )
    assert changed.usage.prompt_tokens > 0
    assert changed.choices[0].message.content != answer.choices[0].message.content


def test_a_session_stores_and_replays_tool_calls(gateway: Service, api_key: str, sdk: OpenAI) -> None:
    http = httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    session_id = http.post("/v1/sessions", json={}).json()["id"]
    in_session = {"session_id": session_id}
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = sdk.chat.completions.create(
        model=SIM_MODEL, messages=ASK, tools=TOOLS, tool_choice=named, seed=16, extra_body=in_session
    )
    [call] = first.choices[0].message.tool_calls
    result = tool_turns(call)[1]
    second = sdk.chat.completions.create(
        model=SIM_MODEL,
        messages=[result],
        tools=TOOLS,
        seed=17,
        max_tokens=6,
        tool_choice="none",
        extra_body=in_session,
    )
    stored = http.get(f"/v1/sessions/{session_id}/messages").json()["data"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    [stored_call] = stored[1]["tool_calls"]
    assert stored_call["id"] == call.id and stored_call["function"]["name"] == "get_weather"
    assert json.loads(stored_call["function"]["arguments"]) == json.loads(call.function.arguments)
    assert stored[2]["tool_call_id"] == call.id and stored[2]["content"] == result["content"]
    assert stored[3]["content"] == second.choices[0].message.content
    # Replayed: the session's turn saw the same conversation as one sent whole.
    stateless = sdk.chat.completions.create(
        model=SIM_MODEL, messages=[*ASK, *tool_turns(call)], tools=TOOLS, seed=17, max_tokens=6, tool_choice="none"
    )
    assert stateless.choices[0].message.content == second.choices[0].message.content


# ---------------------------------------------------------------------------------------------
# Bad input: 400 naming the parameter
# ---------------------------------------------------------------------------------------------

BAD_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}},
}
BROKEN_TOOL = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object", "required": "a"}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": BAD_SCHEMA}, "response_format"),
        ({"tools": [BROKEN_TOOL]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 9}, "n"),
        ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
    ],
)
def test_bad_input_is_a_400_naming_its_param(sdk: OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, max_tokens=4, **fields)
    assert refused.value.type == "invalid_request_error"
    assert refused.value.param is not None and refused.value.param.split(".")[0].split("[")[0] == param, (
        refused.value.body
    )


def test_n_with_a_session_is_refused(gateway: Service, api_key: str, sdk: OpenAI) -> None:
    http = httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    session_id = http.post("/v1/sessions", json={}).json()["id"]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, n=2, extra_body={"session_id": session_id})
    assert refused.value.param == "n"


def test_unknown_fields_are_refused_as_openai_refuses_them(sdk: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as one:
        sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, extra_body={"frobnicate": 1})
    assert one.value.body == {
        "message": "Unrecognized request argument supplied: frobnicate",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    with pytest.raises(openai.BadRequestError) as two:
        sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, extra_body={"zeta": 1, "alpha": 2})
    assert two.value.body["message"] == "Unrecognized request arguments supplied: alpha, zeta"
    # Nested objects take extra keys: clients send them (instructor's `name` on a tool message).
    ok = sdk.chat.completions.create(
        model=SIM_MODEL, messages=[{"role": "user", "content": "hi", "x-extra": 1}], max_tokens=2
    )
    assert ok.choices[0].message.content


def test_a_parameter_the_engine_does_not_honour_is_refused_by_name(sdk: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=SIM_MODEL, messages=ASK, max_tokens=4, presence_penalty=0.5)
    assert refused.value.param == "presence_penalty"
    assert refused.value.type == "invalid_request_error"


# ---------------------------------------------------------------------------------------------
# Failover of a constrained stream
# ---------------------------------------------------------------------------------------------


def test_a_json_schema_stream_survives_a_kill_9_with_identical_text(
    stack: Stack, gateway: Service, api_key: str, checked: ContractTransport
) -> None:
    model = "contract-failover-sim"
    workers = [sim_worker(stack, f"contract-failover-{i}", model, AXON_SIM_ITL_MS="20") for i in range(2)]
    client = openai_client(gateway, api_key, checked)
    wait_listed(client, model)
    schema = Weather.model_json_schema()
    request = schema_request(model, ASK, "weather", schema, seed=18, max_tokens=400)
    reference = client.chat.completions.create(**request)
    kill_at = max(2, reference.usage.completion_tokens // 3)
    pieces = []
    for chunk in client.chat.completions.create(**request, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if len(pieces) == kill_at:
            holder(workers, model).kill()
    text = "".join(pieces)
    assert text == reference.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    survivor = next(w for w in workers if w.process.poll() is None)
    assert metric(survivor, "axon_worker_jobs_total", model=model, outcome="resumed") == 1
