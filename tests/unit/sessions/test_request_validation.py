"""Bad input to the completion routes: each a 400 in OpenAI's error shape naming its `param`,
refused before the service sees the request; and the capability check against the model's workers."""

from collections.abc import AsyncIterator
from typing import Any, get_args

import httpx
import orjson
import pytest

from services.sessions.app import create_app
from services.sessions.catalog import ModelCatalog, require_supported
from services.sessions.deps import SessionServices
from services.sessions.job_building import JobBuilder
from services.sessions.messages.service import MessagesService
from services.sessions.metrics import SessionsMetrics
from services.sessions.settings import SessionsSettings
from shared.errors import Conflict, InvalidRequest
from shared.openai_requests import RequestLimits, parse_request
from shared.registry import LiveModel
from shared.schemas import Capability

ERROR_KEYS = {"message", "type", "param", "code"}
INTERNAL_TOKEN = "unit-internal-token-0123456789abcdef"
HEADERS = {"x-axon-tenant": "t", "authorization": f"Bearer {INTERNAL_TOKEN}"}
MESSAGES = [{"role": "user", "content": "Hello"}]
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


class _Service:
    """Stands for the completion service: a request that gets past validation is answered 409
    `reached_service` (a bad one must never get here)."""

    async def start(self, *_args: Any, **_kwargs: Any) -> None:
        raise Conflict("The request reached the service.", code="reached_service")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    settings = SessionsSettings(max_choices=4, max_schema_bytes=2048, internal_token=INTERNAL_TOKEN)
    app = create_app(settings)
    # Only what a request reaches before the service (the app is not started: nothing is open).
    app.state.services = SessionServices(
        completions=_Service(),  # type: ignore[arg-type]
        chat=None,  # type: ignore[arg-type]
        responses=None,  # type: ignore[arg-type]
        messages=MessagesService(
            completions=_Service(),  # type: ignore[arg-type]
            limits=settings.request_limits,
            metrics=SessionsMetrics(),
        ),
        run_on=None,  # type: ignore[arg-type]
        # Read only for a metric's label (`ModelCatalog.label`: its cache, empty here; no registry call).
        catalog=ModelCatalog(None, cache_ttl_s=1.0),  # type: ignore[arg-type]
        sessions=None,  # type: ignore[arg-type]
        chunk_log=None,  # type: ignore[arg-type]
        metrics=SessionsMetrics(),
        request_limits=settings.request_limits,
        files=None,  # type: ignore[arg-type]
        batches=None,  # type: ignore[arg-type]
        file_max_bytes=settings.file_max_bytes,
    )
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://sessions", headers=HEADERS) as c:
        yield c


async def post(client: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    response = await client.post(path, content=orjson.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    payload = response.json()
    assert list(payload) == ["error"] and set(payload["error"]) == ERROR_KEYS, payload
    error: dict[str, Any] = payload["error"]
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    return error


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, **fields}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # An invalid JSON Schema, a tool with broken parameters.
        (chat(response_format=json_schema({"type": "objekt"})), "response_format"),
        (chat(response_format=json_schema({"properties": {"a": {"minimum": "zero"}}})), "response_format"),
        (chat(response_format=json_schema({"required": "a"})), "response_format"),
        (chat(response_format={"type": "json_schema"}), "response_format"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}), None),
        (chat(response_format={"type": "xml"}), "response_format.type"),
        (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]), None),
        (chat(tools=[TOOL, {**TOOL, "function": {"name": "g", "parameters": {"properties": []}}}]), None),
        (chat(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools.0.function.name"),
        (chat(tools=[{"type": "function", "function": {"name": "x" * 65}}]), "tools.0.function.name"),
        (chat(tools=[{"type": "custom", "custom": {"name": "f"}}]), "tools.0.type"),
        (chat(tools=[TOOL, TOOL]), "tools.1.function.name"),
        # tool_choice naming a function not in tools, or needing tools there are none of.
        (chat(tools=[TOOL], tool_choice=named("get_time")), "tool_choice"),
        (chat(tool_choice=named("get_weather")), "tool_choice"),
        (chat(tool_choice="required"), "tool_choice"),
        (chat(tools=[TOOL], tool_choice="sometimes"), "tool_choice"),
        (chat(tools=[TOOL], tool_choice={"type": "function"}), "tool_choice"),
        # Logprobs.
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(logprobs=False, top_logprobs=2), "top_logprobs"),
        # n over the limit (AXON_MAX_CHOICES, here 4; OpenAI's own bound is 128), n with a session.
        (chat(n=5), "n"),
        (chat(n=129), "n"),
        (chat(n=0), "n"),
        (chat(n=2, session_id="3f1d0c1e-0000-4000-8000-000000000000"), "n"),
        # logit_bias keys that are not token ids, values outside [-100, 100].
        (chat(logit_bias={"hello": 1}), "logit_bias"),
        (chat(logit_bias={"-5": 1}), "logit_bias"),
        (chat(logit_bias={"1.5": 1}), "logit_bias"),
        (chat(logit_bias={"50256": 101}), "logit_bias"),
        (chat(logit_bias={"50256": -100.5}), "logit_bias"),
        (chat(logit_bias={"50256": "high"}), "logit_bias"),
        (chat(logit_bias=[1, 2]), "logit_bias"),
        # Ranges.
        (chat(temperature=2.5), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(presence_penalty=2.1), "presence_penalty"),
        (chat(frequency_penalty=-3), "frequency_penalty"),
        (chat(repetition_penalty=0), "repetition_penalty"),
        (chat(min_p=1.5), "min_p"),
        (chat(top_k=-2), "top_k"),
        (chat(min_tokens=-1), "min_tokens"),
        (chat(seed=2**63), "seed"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (chat(stop=[1]), "stop"),
        (chat(model=""), "model"),
        # Messages.
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m"}, "messages"),
        (chat(messages=[{"role": "robot", "content": "hi"}]), "messages.0.role"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
        (chat(messages=[{"role": "user", "content": None}]), "messages.0.content"),
        (chat(messages=[MESSAGES[0], {"role": "tool", "content": "18C"}]), "messages.1.tool_call_id"),
        (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages.0.content",
        ),
        (chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages.0.tool_calls"),
        (
            chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {}}]}]),
            "messages.0.tool_calls.0.function.name",
        ),
        # Known OpenAI fields Axon does not honour.
        (chat(store=True), "store"),
        (chat(service_tier="flex"), "service_tier"),
        (chat(modalities=["text", "audio"]), "modalities"),
        (chat(audio={"voice": "alloy", "format": "mp3"}), "audio"),
        (chat(prediction={"type": "content", "content": "x"}), "prediction"),
        (chat(reasoning_effort="low"), "reasoning_effort"),
        (chat(verbosity="low"), "verbosity"),
        (chat(web_search_options={}), "web_search_options"),
        (chat(functions=[{"name": "f"}]), "functions"),
        (chat(function_call="auto"), "function_call"),
        (chat(metadata={"a": "b"}), "metadata"),
        (chat(prompt_cache_key="k"), "prompt_cache_key"),
        (chat(safety_identifier="u"), "safety_identifier"),
    ],
)
async def test_bad_chat_input_is_a_400_naming_its_param(
    client: httpx.AsyncClient, body: dict[str, Any], param: str | None
) -> None:
    error = await post(client, body)
    if param is None:  # a broken schema inside tools/response_format: the path to it
        assert error["param"] is not None and error["param"].split(".")[0] in {"tools", "response_format"}
    else:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"n": 5}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "The end."}, "suffix"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"echo": "yes"}, "echo"),
    ],
)
async def test_bad_completion_input_is_a_400_naming_its_param(
    client: httpx.AsyncClient, fields: dict[str, Any], param: str
) -> None:
    error = await post(client, {"model": "m", "prompt": "Once", **fields}, path="/v1/completions")
    assert error["param"] == param, error


async def test_unsupported_known_fields_say_so(client: httpx.AsyncClient) -> None:
    error = await post(client, chat(store=True))
    assert error == {
        "message": "Unsupported parameter: 'store' is not supported.",
        "type": "invalid_request_error",
        "param": "store",
        "code": "unsupported_parameter",
    }


async def test_an_unknown_field_is_refused_as_openai_does(client: httpx.AsyncClient) -> None:
    error = await post(client, chat(top_n=3))
    assert error == {
        "message": "Unrecognized request argument supplied: top_n",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


async def test_several_unknown_fields_are_listed_sorted(client: httpx.AsyncClient) -> None:
    # Known-but-unsupported `store` is not "unrecognized"; other errors wait for the unknown ones.
    error = await post(client, chat(guided_json={}, chat_template="x", store=True, temperature=9))
    assert error == {
        "message": "Unrecognized request arguments supplied: chat_template, guided_json",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    error = await post(client, {"model": "m", "prompt": "x", "messages": MESSAGES}, path="/v1/completions")
    assert error["message"] == "Unrecognized request argument supplied: messages"


async def test_nested_objects_accept_extra_keys(client: httpx.AsyncClient) -> None:
    """Clients replay whole SDK objects (a message's `refusal`, `annotations`, `audio`): only the
    top level is strict."""
    body = chat(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "ok", "refusal": None, "annotations": []},
        ],
        stream_options={"include_usage": True, "include_obfuscation": True},
        tools=[{**TOOL, "function": {**TOOL["function"], "x-extra": 1}}],
    )
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 409 and response.json()["error"]["code"] == "reached_service", response.text


async def test_a_body_that_is_not_json_or_not_an_object(client: httpx.AsyncClient) -> None:
    for raw in (b"{not json", b"[]", b'"text"', b""):
        response = await client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400, (raw, response.text)
        assert set(response.json()["error"]) == ERROR_KEYS


async def test_a_schema_past_the_size_limit_is_refused(client: httpx.AsyncClient) -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    error = await post(client, chat(response_format=json_schema(big)))
    assert error["param"] == "response_format"
    assert "2048" in error["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": big}}
    error = await post(client, chat(tools=[tool]))
    assert error["param"] == "tools.0.function.parameters"


@pytest.mark.parametrize("depth", [150, 1000])
async def test_a_deeply_nested_schema_is_a_400_not_a_crash(client: httpx.AsyncClient, depth: int) -> None:
    schema = '{"items": ' * depth + '{"type": "integer"}' + "}" * depth
    body = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": '
    body += '{"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + schema + "}}}"
    response = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    # Within the JSON parser's nesting limit the schema is valid (and reaches the service).
    assert response.status_code == (409 if depth == 150 else 400), response.text


# The capability check ------------------------------------------------------------------------

# Every parameter an engine may or may not honour.
ALL = frozenset(get_args(Capability))


def _request(kind: str, **fields: Any) -> Any:
    base = chat() if kind == "chat" else {"model": "m", "prompt": "x"}
    return parse_request(kind, orjson.dumps({**base, **fields}), RequestLimits())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("chat", {"tools": [TOOL]}, "tools"),
        ("chat", {"tools": [TOOL], "tool_choice": named("get_weather")}, "tools"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"logprobs": True, "top_logprobs": 3}, "logprobs"),
        ("chat", {"presence_penalty": 0.5}, "presence_penalty"),
        ("chat", {"frequency_penalty": -1}, "frequency_penalty"),
        ("chat", {"repetition_penalty": 1.2}, "repetition_penalty"),
        ("chat", {"logit_bias": {"1": 5}}, "logit_bias"),
        ("chat", {"seed": 0}, "seed"),
        ("chat", {"stop": "\n"}, "stop"),
        ("chat", {"top_k": 5}, "top_k"),
        ("chat", {"min_p": 0.1}, "min_p"),
        ("chat", {"min_tokens": 3}, "min_tokens"),
        ("chat", {"ignore_eos": True}, "ignore_eos"),
        ("completion", {"echo": True}, "echo"),
        ("completion", {"logprobs": 0}, "logprobs"),
    ],
)
def test_a_parameter_the_models_workers_do_not_all_honour_is_refused(
    kind: str, fields: dict[str, Any], param: str
) -> None:
    body = _request(kind, **fields)
    require_supported(body, "m", LiveModel(workers=1, context_tokens=2048, supports=ALL))
    with pytest.raises(InvalidRequest) as info:
        require_supported(body, "tiny", LiveModel(workers=2, context_tokens=2048, supports=ALL - {param}))
    assert info.value.status_code == 400
    assert info.value.body()["error"] == {
        "message": f"{param} is not supported by the engine serving model tiny.",
        "type": "invalid_request_error",
        "param": param,
        "code": "unsupported_parameter",
    }


def test_a_plain_request_needs_nothing_of_the_engine() -> None:
    nothing = LiveModel(workers=1, context_tokens=2048, supports=frozenset())
    require_supported(_request("chat", temperature=0.2, top_p=0.5, max_tokens=3, n=2), "m", nothing)
    require_supported(_request("chat", tools=[TOOL], tool_choice="none", top_k=-1, presence_penalty=0), "m", nothing)
    require_supported(_request("completion", echo=False), "m", nothing)


async def test_a_schema_with_an_integer_beyond_64_bits_is_a_400_not_a_crash(client: httpx.AsyncClient) -> None:
    schema = '{"type": "integer", "minimum": ' + "9" * 40 + "}"
    body = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": '
    body += '{"type": "json_schema", "json_schema": {"name": "big", "schema": ' + schema + "}}}"
    response = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == ("response_format", "invalid_request_error")
    assert "64-bit" in error["message"]


def test_a_schema_max_tokens_cannot_hold_is_refused_before_any_job() -> None:
    """The bound of shared/schema_bounds.py, checked where max_tokens is known: the request's, or
    the default (`AXON_DEFAULT_MAX_TOKENS`, at most half the context)."""
    jobs = JobBuilder(SessionsSettings(internal_token=INTERNAL_TOKEN, default_max_tokens=100))
    live = LiveModel(workers=1, context_tokens=2048, supports=ALL)
    long_text = {"type": "object", "properties": {"t": {"type": "string", "minLength": 20_000}}, "required": ["t"]}
    assert (
        jobs.sampling(_request("chat", response_format=json_schema(long_text), max_tokens=157), live).max_tokens == 157
    )
    for fields in ({"max_tokens": 156}, {}):
        with pytest.raises(InvalidRequest) as refused:
            jobs.sampling(_request("chat", response_format=json_schema(long_text), **fields), live)
        assert refused.value.param == "response_format"
    tool = {"type": "function", "function": {"name": "f", "parameters": long_text}}
    with pytest.raises(InvalidRequest) as refused:
        jobs.sampling(_request("chat", tools=[tool], tool_choice="required"), live)
    assert refused.value.param == "tools"


@pytest.mark.parametrize(
    ("kind", "max_tokens", "param", "code"),
    [
        # More than the whole context: OpenAI's context_length_exceeded, naming the input.
        ("chat", 2049, "messages", "context_length_exceeded"),
        ("completion", 2049, "prompt", "context_length_exceeded"),
        # Within the context, above AXON_MAX_TOKENS_LIMIT: OpenAI's "max_tokens is too large", code null.
        ("chat", 1025, "max_tokens", None),
    ],
)
def test_max_tokens_past_the_context_or_the_limit_is_refused_as_openai_refuses_it(
    kind: str, max_tokens: int, param: str, code: str | None
) -> None:
    jobs = JobBuilder(SessionsSettings(internal_token=INTERNAL_TOKEN, max_tokens_limit=1024))
    live = LiveModel(workers=1, context_tokens=2048, supports=ALL)
    assert jobs.sampling(_request(kind, max_tokens=1024), live).max_tokens == 1024
    with pytest.raises(InvalidRequest) as refused:
        jobs.sampling(_request(kind, max_tokens=max_tokens), live)
    assert (refused.value.param, refused.value.code) == (param, code)
    assert str(max_tokens) in refused.value.message


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_messages_routes_answer_in_anthropics_shape_with_a_request_id(
    client: httpx.AsyncClient, path: str
) -> None:
    bad = await client.post(path, content=b'{"model": "m", "messages": [], "max_tokens": 1}')
    assert bad.status_code == 400 and bad.headers["request-id"] == bad.headers["x-request-id"]
    assert bad.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages: List should have at least 1 item after validation, not 0",
        },
    }
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if path == "/v1/messages":
        body["max_tokens"] = 5
    reached = await client.post(path, content=orjson.dumps(body))
    assert reached.status_code == 409  # the stand-in service's refusal, in Anthropic's shape too
    assert reached.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "The request reached the service."},
    }
    unknown = await client.get("/v1/messages/nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
