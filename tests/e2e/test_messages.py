"""Anthropic's Messages API through the official `anthropic` SDK, on the shared stack (sim engine):
sync and async messages, the streaming helpers (`messages.stream`, `text_stream`,
`get_final_message`) and the raw event sequence, stop sequences, tools (forced, streamed as
`input_json_delta`, and a `tool_result` round trip), `count_tokens`, the SDK's exceptions for
Anthropic's error types and statuses, the key in either header, Anthropic's rate-limit headers, a
client gone (its job cancelled) and a worker killed mid-stream (the same text goes on).

The real model (vLLM, the bundled SmolLM2): tests/e2e/test_vllm_engine.py."""

import asyncio
import time

import anthropic
import httpx
import orjson
import pytest
from anthropic import Anthropic, AsyncAnthropic

from services.cli.launcher import Service
from shared.keys import KeyLimits
from tests.conftest import create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import Stack
from tests.e2e.test_workers import client_for, holder, metric, sim_worker, wait_listed

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Tell me about the sea."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def claude(gateway: Service, api_key: str) -> Anthropic:
    return Anthropic(base_url=gateway.url, api_key=api_key, max_retries=0, timeout=30)


def test_a_message_whole_with_system_metadata_and_headers(claude: Anthropic) -> None:
    raw = claude.messages.with_raw_response.create(
        model=SIM_MODEL,
        max_tokens=6,
        system=[{"type": "text", "text": "Be brief."}],
        messages=QUESTION,
        metadata={"user_id": "user-1"},
        extra_headers={"anthropic-version": "2023-06-01"},
    )
    message = raw.parse()
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == SIM_MODEL
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0
    assert raw.headers["request-id"] == raw.headers["x-request-id"]
    assert int(raw.headers["anthropic-ratelimit-requests-limit"]) == 1_000_000
    assert raw.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert "x-ratelimit-limit-requests" not in raw.headers


def test_a_stop_sequence_ends_the_answer_and_is_named(claude: Anthropic) -> None:
    whole = claude.messages.create(model=SIM_MODEL, max_tokens=12, messages=QUESTION).content[0].text
    words = whole.split(" ")
    stop = " " + words[3]
    cut = claude.messages.create(model=SIM_MODEL, max_tokens=12, messages=QUESTION, stop_sequences=[stop, "zzzz"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == whole[: whole.index(stop)]


def test_the_streaming_helpers_give_the_whole_answer(claude: Anthropic) -> None:
    whole = claude.messages.create(model=SIM_MODEL, max_tokens=8, messages=QUESTION)
    with claude.messages.stream(model=SIM_MODEL, max_tokens=8, messages=QUESTION) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == (
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    )


def test_the_raw_stream_is_anthropics_event_sequence(gateway: Service, api_key: str) -> None:
    body = {"model": SIM_MODEL, "max_tokens": 4, "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/messages", json=body, headers={"x-api-key": api_key}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


async def test_async_create_and_stream(gateway: Service, api_key: str) -> None:
    client = AsyncAnthropic(base_url=gateway.url, api_key=api_key, max_retries=0, timeout=30)
    created, streamed = await asyncio.gather(
        client.messages.create(model=SIM_MODEL, max_tokens=5, messages=QUESTION),
        _streamed(client),
    )
    assert created.content[0].text == streamed
    await client.close()


async def _streamed(client: AsyncAnthropic) -> str:
    async with client.messages.stream(model=SIM_MODEL, max_tokens=5, messages=QUESTION) as stream:
        return "".join([text async for text in stream.text_stream])


def test_a_forced_tool_call_whole_and_streamed_then_its_result(claude: Anthropic) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    message = claude.messages.create(model=SIM_MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice=forced)
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)
    assert message.stop_reason == "tool_use"
    deltas = []
    with claude.messages.stream(
        model=SIM_MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice=forced
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                deltas.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == call.input
    assert orjson.loads("".join(deltas)) == call.input
    answer = claude.messages.create(
        model=SIM_MODEL,
        max_tokens=5,
        tools=[WEATHER],
        messages=[
            *ask,
            {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C"}]},
        ],
    )
    assert answer.content[0].type == "text" and answer.stop_reason == "max_tokens"


def test_count_tokens_is_what_the_engine_reads(claude: Anthropic) -> None:
    counted = claude.messages.count_tokens(model=SIM_MODEL, messages=QUESTION, system="Be brief.")
    used = claude.messages.create(model=SIM_MODEL, max_tokens=1, messages=QUESTION, system="Be brief.").usage
    assert counted.input_tokens == used.input_tokens + (used.cache_read_input_tokens or 0) > 0


def test_errors_are_the_sdks_exceptions_in_anthropics_shape(gateway: Service, claude: Anthropic) -> None:
    with pytest.raises(anthropic.AuthenticationError) as auth:
        Anthropic(base_url=gateway.url, api_key="axk_wrong", max_retries=0).messages.create(
            model=SIM_MODEL, max_tokens=5, messages=QUESTION
        )
    assert isinstance(auth.value.body, dict) and set(auth.value.body) == {"type", "error"}
    assert auth.value.body["type"] == "error" and auth.value.body["error"]["type"] == "authentication_error"
    assert auth.value.response.headers["request-id"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=5, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"
    for body, field in [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
        ({"messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
        ({"messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"messages": [*QUESTION, {"role": "assistant", "content": "Sure"}]}, "messages.1.role"),
        ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
        # Not among the newest SDK's parameters (Anthropic's API still takes them): sent as extra fields.
        ({"messages": QUESTION, "extra_body": {"top_k": 5}}, "top_k"),
        ({"messages": QUESTION, "extra_body": {"temperature": 1.5}}, "temperature"),
    ]:
        with pytest.raises(anthropic.BadRequestError) as bad:
            claude.messages.create(**{"model": SIM_MODEL, "max_tokens": 5, **body})
        error = bad.value.body["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{field}:"), error
    unknown = httpx.post(f"{gateway.url}/v1/messages/nope", headers={"x-api-key": claude.api_key}, json={}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


def test_a_key_in_authorization_a_rate_limit_and_a_model_not_allowed(gateway: Service, database_url: str) -> None:
    limited = asyncio.run(create_key(database_url, name="messages-rpm", limits=KeyLimits(rpm=1), tenant="msg-rpm"))
    client = Anthropic(base_url=gateway.url, auth_token=limited, max_retries=0, timeout=30)
    client.messages.create(model=SIM_MODEL, max_tokens=2, messages=QUESTION)
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(model=SIM_MODEL, max_tokens=2, messages=QUESTION)
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    headers = refused.value.response.headers
    assert int(headers["retry-after"]) >= 1 and headers["anthropic-ratelimit-requests-remaining"] == "0"
    narrow = asyncio.run(
        create_key(database_url, name="messages-narrow", limits=KeyLimits(), tenant="msg-narrow", models=["other"])
    )
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        Anthropic(base_url=gateway.url, api_key=narrow, max_retries=0).messages.create(
            model=SIM_MODEL, max_tokens=2, messages=QUESTION
        )
    assert denied.value.body["error"]["type"] == "permission_error"


def test_a_client_gone_cancels_its_job(gateway: Service, sim_worker: Service, api_key: str) -> None:
    cancelled = metric(sim_worker, "axon_worker_jobs_total", model=SIM_MODEL, outcome="cancelled")
    body = {"model": SIM_MODEL, "max_tokens": 4000, "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/messages", json=body, headers={"x-api-key": api_key}) as response:
        lines = response.iter_lines()
        while "content_block_delta" not in next(lines):
            pass
    deadline = time.monotonic() + 5
    while metric(sim_worker, "axon_worker_jobs_total", model=SIM_MODEL, outcome="cancelled") <= cancelled:
        assert time.monotonic() < deadline, "the worker did not abort the abandoned stream"
        time.sleep(0.1)


def test_a_worker_killed_mid_stream_the_same_text_goes_on(stack: Stack, gateway: Service, api_key: str) -> None:
    model = "messages-failover-sim"
    workers = [sim_worker(stack, f"messages-failover-{i}", model, AXON_SIM_ITL_MS="20") for i in range(2)]
    wait_listed(client_for(gateway, api_key), model)
    claude = Anthropic(base_url=gateway.url, api_key=api_key, max_retries=0, timeout=60)
    expected = claude.messages.create(model=model, max_tokens=80, messages=QUESTION).content[0].text
    pieces: list[str] = []
    with claude.messages.stream(model=model, max_tokens=80, messages=QUESTION) as stream:
        for text in stream.text_stream:
            pieces.append(text)
            if len(pieces) == 20:
                holder(workers, model).kill()
        final = stream.get_final_message()
    assert "".join(pieces) == expected and final.stop_reason == "max_tokens"
    survivor = next(w for w in workers if w.process.poll() is None)
    assert metric(survivor, "axon_worker_jobs_total", model=model, outcome="resumed") == 1
