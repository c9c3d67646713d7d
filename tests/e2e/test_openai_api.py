"""The public API through all three services, driven by the official `openai` client."""

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from services.cli.launcher import Service, environment_with
from tests.e2e.conftest import SIM_MODEL

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Say something."}]
ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_example_is_the_file_it_runs_and_streams_an_answer(gateway: Service, api_key: str) -> None:
    readme = (ROOT / "README.md").read_text()
    run = re.search(r"`python (\S+\.py)`", readme[readme.index("with the official client") :])
    assert run is not None
    example = ROOT / run.group(1)
    shown = readme[readme.index("```python", run.end()) + len("```python\n") :]
    assert shown[: shown.index("```")] in example.read_text()  # the README shows the file's code
    env = environment_with({"AXON_API_KEY": api_key, "AXON_GATEWAY_PORT": str(gateway.port), "AXON_MODEL": SIM_MODEL})
    done = subprocess.run([sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) > 3, done.stdout  # the simulator's words, streamed


def test_models_lists_the_live_worker_model(client: OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert SIM_MODEL in ids


def test_models_retrieve_gives_the_model_with_its_context_and_capabilities(
    client: OpenAI, gateway: Service, auth: dict
) -> None:
    model = client.models.retrieve(SIM_MODEL)
    assert (model.id, model.object, model.owned_by) == (SIM_MODEL, "model", "axon")
    raw = httpx.get(f"{gateway.url}/v1/models/{SIM_MODEL}", headers=auth, timeout=30).json()
    assert raw["context_length"] > 0
    assert raw["capabilities"] == sorted(raw["capabilities"])
    assert raw["engines"] == ["sim"]  # which engine serves it (the vLLM engine's own test: test_vllm_engine)
    listed = {m.id: m.model_dump(exclude_unset=True) for m in client.models.list().data}
    assert listed[SIM_MODEL] == raw


@pytest.mark.parametrize("name", ["no-such-model", "org/no-such-model", "line\nbreak"])
def test_models_retrieve_of_an_unknown_model_is_not_found(client: OpenAI, name: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve(name)
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 1000}, "n"),
        ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"extra_body": {"store": True}}, "store"),
        ({"extra_body": {"guided_json": {}}}, None),
    ],
)
def test_bad_input_is_a_400_naming_its_param(client: OpenAI, fields: dict, param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=2, **fields)
    assert info.value.param == param
    if param is None:
        assert info.value.body["message"] == "Unrecognized request argument supplied: guided_json"  # type: ignore[index]


def test_chat_non_streaming_returns_completion_with_usage(client: OpenAI) -> None:
    response = client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=7, seed=1)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert len(response.choices[0].message.content.split()) == 7
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 7
    assert response.usage.total_tokens == response.usage.prompt_tokens + 7


def test_chat_streaming_matches_non_streaming_and_reports_usage(client: OpenAI) -> None:
    whole = client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=12, seed=3)
    stream = client.chat.completions.create(
        model=SIM_MODEL,
        messages=MESSAGES,
        max_tokens=12,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_stream_ends_with_done_marker(gateway: Service, auth: dict) -> None:
    body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=auth, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert 2 <= len(events) <= 3 + 1  # up to one event per token (the last carries finish_reason), then [DONE]


def test_completions_streaming_and_not(client: OpenAI) -> None:
    whole = client.completions.create(model=SIM_MODEL, prompt="Once upon a time", max_tokens=6, seed=5)
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens == 6
    streamed = client.completions.create(
        model=SIM_MODEL,
        prompt="Once upon a time",
        max_tokens=6,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_stop_sequence_ends_the_answer_early(client: OpenAI) -> None:
    full = client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=30, seed=9)
    words = full.choices[0].message.content.split(" ")
    stop = " " + words[3]
    cut = client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=30, seed=9, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full.choices[0].message.content.split(stop)[0]


async def test_sixteen_concurrent_streams_all_complete(aclient: AsyncOpenAI) -> None:
    async def one(i: int) -> tuple[int, str | None]:
        stream = await aclient.chat.completions.create(
            model=SIM_MODEL, messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=40, stream=True
        )
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        return len("".join(pieces).split()), finish

    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert results == [(40, "length")] * 16


def test_request_id_travels_to_the_worker_and_back(gateway: Service, sim_worker: Service, auth: dict) -> None:
    request_id = "e2e-trace-4711"
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 2},
        headers={"x-request-id": request_id, **auth},
        timeout=30,
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == request_id
    job_id = response.json()["id"].removeprefix("chatcmpl-")
    line = wait_for_log_line(sim_worker, lambda e: e.get("event") == "job_finished" and e.get("job_id") == job_id)
    assert line["request_id"] == request_id
    assert line["service"] == "worker"


def wait_for_log_line(service: Service, match, timeout_s: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for raw in service.log_text().splitlines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict) and match(entry):
                return entry
        time.sleep(0.1)
    raise AssertionError(f"no matching log line in {service.name}")
