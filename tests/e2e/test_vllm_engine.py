"""The default engine through the whole stack: a worker started with no engine or model chosen runs the
real vLLM (its CPU build here) on the bundled SmolLM2, and the official `openai` client, instructor
and LangChain use it as they would any OpenAI endpoint. Every answer and chunk is checked against
OpenAI's schemas on the way (`tests/contract/transport.py`). A small batch (issue 28) runs on the
same worker: each line's answer is the one the same greedy request gets online, and a line the
endpoint refuses is its 400 in the error file. Anthropic's `anthropic` SDK drives the Messages API
on it too (whole, streamed, stopped, counted, tools), and a small Message Batch (each Message the
one the same request gets online).

One worker for the module's contract tests (about 40 s to start); the last tests start two more
of the same, together (their loads overlap), and kill, stop or drain them:

- three workers: one-shot questions about documents go, from their second round, to the worker
  whose cache holds the document (vLLM's KV-cache events feed the prefix index);
- a worker killed (-9) mid-answer: another resumes the job and the client's stream is the answer
  an uninterrupted run gives, word for word (plain, and constrained by a JSON schema), with nothing
  of the dead worker left running;
- a stop (SIGTERM) drains: the answers in flight finish, then the worker exits 0.

Requests are short, greedy where an exact answer is compared. (Tensor parallelism, vLLM's engine
core killed alone and a failed start: tests/e2e/test_vllm_parallel.py.)
"""

import asyncio
import json
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import anthropic
import httpx
import instructor
import openai
import pytest
import torch
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI, OpenAI
from openai.types import Batch
from pydantic import BaseModel, Field
from safetensors.torch import load_file

from services.cli import launcher
from services.cli.launcher import Service
from services.worker.engines.gguf import bundled_gguf_path, converted_model
from services.worker.engines.orphans import descendants
from shared.keys import KeyLimits
from shared.settings import DEFAULT_MODEL
from tests.conftest import create_key
from tests.contract.transport import ContractTransport
from tests.e2e.conftest import FRANCE
from tests.e2e.hostile_schemas import ADMITTED, NOWHERE, REFUSED, TOO_COMPLEX, Sender, check, health_watched
from tests.e2e.load import report
from tests.e2e.otlp import OtlpReceiver
from tests.e2e.stack import INTERNAL_AUTH, Stack
from tests.e2e.test_workers import holder, metric, wait_listed
from tests.e2e.vllm import VllmWorkers, no_process_left, stream_killing
from tests.metric_names import Scrape, queried_metrics
from tests.models import steering_lora
from tests.processes import niceness
from tests.waiting import wait_for

# `alone` (make test runs it with no other test beside it):
# vLLM keeps both cores busy, and its tests time first tokens beside a burst.
pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.timeout(300), pytest.mark.alone]

# Nothing chosen: the default engine serves the default model under its own name.
MODEL = DEFAULT_MODEL
ADAPTER = "smollm2-e2e-lora"
STEERED = "London"  # the first token of the adapter's answer to STORY (tests.models.steering_lora)
STORY = [{"role": "user", "content": "Tell me a story about a dog."}]
ENDED = {"completed", "failed", "expired", "cancelled"}  # a batch's final statuses
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def asked_weather(index: int, city: str) -> list[dict]:
    call = {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]


# Hand-written assistant turns that called the tool: the 135M model then writes a call of its own,
# which vLLM's hermes parser reads.
FEW_SHOT = [*asked_weather(0, "Paris"), *asked_weather(1, "Rome"), *asked_weather(2, "Oslo")]


class City(BaseModel):
    """A city."""

    name: str = Field(max_length=24)
    country: Literal["France", "Germany", "Italy", "Spain"]
    capital: bool


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    """Where the workers export their spans and vLLM its own (`AXON_OTLP_ENDPOINT`)."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def workers(
    stack: Stack, vllm_model_cache: Path, tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> Iterator[VllmWorkers]:
    """The module's workers: no engine, model or dtype chosen, and a LoRA adapter of the model (whose
    answer to STORY starts with STEERED);
    they trace to `receiver`; stopped with the module (their memory and cores are not the later
    modules' to share). Their torch.compile cache starts empty, as on a fresh machine: what vLLM
    compiles at a first use is compiled in full, not found in an earlier run's cache."""
    converted = converted_model(bundled_gguf_path(), vllm_model_cache)
    adapter = tmp_path_factory.mktemp("lora") / ADAPTER
    steering_lora(adapter, messages=STORY, token=STEERED, base=converted)
    env = {
        "AXON_MODEL_CACHE_DIR": str(vllm_model_cache),
        "AXON_LORA_ADAPTERS": json.dumps({ADAPTER: str(adapter)}),
        "AXON_MAX_SEQS": "16",
        # Batch lines may fill all 16 (the preemption test), none reserved for interactive jobs.
        "AXON_BATCH_RESERVED_SEQS": "0",
        "AXON_OTLP_ENDPOINT": receiver.endpoint,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("torchinductor")),
    }
    pool = VllmWorkers(stack, "vllm", env)
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def vllm_worker(workers: VllmWorkers) -> Service:
    """The first worker, checked on its way up: /health answers while vLLM loads (the load runs off
    the event loop), /ready says why it is not ready."""
    worker = workers.start(ready_path="/health")
    loading = httpx.get(f"{worker.url}/ready", timeout=10)
    assert loading.status_code == 503 and "loading model" in loading.json()["reason"]
    launcher.wait_ready([worker], timeout_s=300)
    return worker


@pytest.fixture(scope="module")
def sdk(vllm_worker: Service, gateway: Service, api_key: str, checked: ContractTransport) -> OpenAI:
    client = OpenAI(
        base_url=f"{gateway.url}/v1",
        api_key=api_key,
        max_retries=0,
        http_client=httpx.Client(transport=checked, timeout=120),
    )
    wait_listed(client, MODEL)
    wait_listed(client, ADAPTER)
    return client


def test_the_default_engine_is_vllm_and_says_so(sdk: OpenAI, gateway: Service, auth: dict) -> None:
    raw = httpx.get(f"{gateway.url}/v1/models/{MODEL}", headers=auth, timeout=10).json()
    assert raw["engines"] == ["vllm"]
    assert raw["context_length"] == 8192
    assert {"tools", "response_format", "logprobs", "logit_bias", "echo", "min_p", "presence_penalty"} <= set(
        raw["capabilities"]
    )
    adapter = httpx.get(f"{gateway.url}/v1/models/{ADAPTER}", headers=auth, timeout=10).json()
    assert (adapter["parent"], adapter["engines"]) == (MODEL, ["vllm"])


def test_the_first_logprobs_request_is_as_quick_as_the_next(sdk: OpenAI) -> None:
    """vLLM compiles (torch.compile) its random sampling and its logprob ranks at their first use,
    11 s on the 2-core machine with an empty compile cache: the worker warms them at start."""
    took_s = []
    for _ in range(4):
        started = time.monotonic()
        sdk.chat.completions.create(
            model=MODEL, messages=FRANCE, temperature=1.0, max_tokens=4, logprobs=True, top_logprobs=2
        )
        took_s.append(time.monotonic() - started)
    first_s, *next_s = took_s
    assert first_s < 3 * statistics.median(next_s) + 1.0, took_s


def test_the_libraries_print_no_notes_warnings_or_progress_bars_at_info(sdk: OpenAI, vllm_worker: Service) -> None:
    """Neither the worker nor vLLM's engine process (its output goes to the same log)."""
    log = vllm_worker.log_text()
    for noise in ("Loading safetensors checkpoint shards", "Triton not", "Warning", "NUMA binding"):
        assert noise not in log, noise


def test_vllms_processes_run_below_the_services_and_the_worker_does_not(vllm_worker: Service) -> None:
    """`AXON_ENGINE_NICE` (10 unset): every thread of vLLM's processes, none of the worker's own."""
    worker = vllm_worker.process.pid
    engine = [pid for pid in descendants(worker) if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::")]
    assert len(engine) >= 2  # the engine core and its CPU worker
    assert {nice for pid in engine for nice in niceness(pid).values()} == {10}
    assert set(niceness(worker).values()) == {os.getpriority(os.PRIO_PROCESS, 0)}


def test_vllms_own_span_is_a_child_of_the_workers_job_span(sdk: OpenAI, receiver: OtlpReceiver) -> None:
    sdk.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4)

    def vllm_under_job() -> list[tuple[str, str]]:
        spans = list(receiver.spans)
        jobs = {s.span_id: s.trace_id for s in spans if s.service == "axon-worker" and s.name == "job"}
        vllm = [s for s in spans if s.name == "llm_request" and s.parent_span_id in jobs]
        return [(s.trace_id, jobs[s.parent_span_id]) for s in vllm]

    deadline = time.monotonic() + 30
    while not (found := vllm_under_job()):
        assert time.monotonic() < deadline, sorted({(s.service, s.name, s.parent_span_id) for s in receiver.spans})
        time.sleep(0.5)
    assert all(vllm_trace == job_trace for vllm_trace, job_trace in found)


def test_streamed_and_whole_greedy_answers_are_the_same(sdk: OpenAI) -> None:
    whole = sdk.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=32)
    assert "Paris" in whole.choices[0].message.content and whole.choices[0].finish_reason == "stop"
    stream = sdk.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=32, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 20


def test_max_tokens_stop_seed_penalties_and_n_are_honoured(sdk: OpenAI) -> None:
    short = sdk.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=3)
    assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("length", 3)
    cut = sdk.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=32, stop=["Paris"])
    assert cut.choices[0].finish_reason == "stop" and "Paris" not in cut.choices[0].message.content
    seeded = [
        sdk.chat.completions.create(model=MODEL, messages=STORY, temperature=1.0, seed=seed, max_tokens=16)
        for seed in (7, 7, 8)
    ]
    texts = [s.choices[0].message.content for s in seeded]
    assert texts[0] == texts[1] != texts[2]
    plain = sdk.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=24)
    penalised = sdk.chat.completions.create(
        model=MODEL, messages=STORY, temperature=0, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0
    )
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    two = sdk.chat.completions.create(model=MODEL, messages=STORY, temperature=1.0, seed=3, n=2, max_tokens=12)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content != two.choices[1].message.content  # choice i samples with seed + i
    assert two.usage.completion_tokens <= 2 * 12


def test_logprobs_and_echo(sdk: OpenAI) -> None:
    chat = sdk.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content).startswith(chat.choices[0].message.content)
    prompt = "The capital of France is"
    plain = sdk.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4, logprobs=2)
    echoed = sdk.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4, logprobs=2, echo=True)
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    answer_tokens = plain.choices[0].logprobs.tokens
    assert choice.logprobs.tokens[-len(answer_tokens) :] == answer_tokens
    assert len(choice.logprobs.tokens) > len(answer_tokens)  # the prompt's tokens, scored by vLLM


def test_structured_outputs_through_the_sdk_instructor_and_langchain(
    sdk: OpenAI, gateway: Service, api_key: str
) -> None:
    paris = [{"role": "user", "content": "Describe Paris, the capital of France."}]
    parsed = sdk.chat.completions.parse(model=MODEL, messages=paris, response_format=City, temperature=0, max_tokens=80)
    assert isinstance(parsed.choices[0].message.parsed, City)
    anything = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the name and country of the capital of France as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    city = instructor.from_openai(sdk, mode=instructor.Mode.JSON_SCHEMA).chat.completions.create(
        model=MODEL, messages=paris, response_model=City, temperature=0, max_tokens=80
    )
    assert isinstance(city, City)
    chat = ChatOpenAI(model=MODEL, base_url=f"{gateway.url}/v1", api_key=api_key, temperature=0, max_tokens=80)
    assert isinstance(chat.with_structured_output(City, method="json_schema").invoke("Describe Paris."), City)
    assert "".join(part.content for part in chat.stream("What is the capital of France?"))


def test_tool_calls_auto_required_and_named(sdk: OpenAI) -> None:
    berlin = {
        "model": MODEL,
        "messages": [*FEW_SHOT, {"role": "user", "content": "Weather in Berlin?"}],
        "tools": [WEATHER],
        "temperature": 0,
        "max_tokens": 60,
    }
    choice = sdk.chat.completions.create(**berlin).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Berlin"})
    assert call.id.startswith("call_")
    streamed = sdk.chat.completions.create(**berlin, stream=True)
    deltas = [d for chunk in streamed if chunk.choices for d in (chunk.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    for choice_of_tool in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = sdk.chat.completions.create(
            model=MODEL, messages=FRANCE, tools=[WEATHER], tool_choice=choice_of_tool, temperature=0, max_tokens=40
        )
        (forced_call,) = forced.choices[0].message.tool_calls
        assert forced_call.function.name == "get_weather"
        assert set(json.loads(forced_call.function.arguments)) == {"city"}


@pytest.fixture(scope="module")
def claude(sdk: OpenAI, gateway: Service, api_key: str) -> anthropic.Anthropic:
    """Anthropic's SDK on the gateway, once the model is listed (`sdk`)."""
    return anthropic.Anthropic(base_url=gateway.url, api_key=api_key, max_retries=0, timeout=120)


# Greedy: the same prompt gives the same answer (not among the newest SDK's parameters: an extra field).
GREEDY = {"temperature": 0}


def test_the_anthropic_sdk_whole_streamed_stopped_and_counted(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=32, messages=FRANCE, extra_body=GREEDY)
    (block,) = whole.content
    assert block.type == "text" and "Paris" in block.text and whole.stop_reason == "end_turn"
    with claude.messages.stream(model=MODEL, max_tokens=32, messages=FRANCE, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == block.text and final.usage.output_tokens == whole.usage.output_tokens
    prompt_tokens = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert claude.messages.count_tokens(model=MODEL, messages=FRANCE).input_tokens == prompt_tokens > 20
    cut = claude.messages.create(
        model=MODEL, max_tokens=32, messages=FRANCE, stop_sequences=["Paris"], extra_body=GREEDY
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", "Paris")
    assert block.text.startswith(cut.content[0].text) and "Paris" not in cut.content[0].text  # type: ignore[union-attr]


def _anthropic_turns(messages: list[dict]) -> list[dict]:
    """FEW_SHOT's turns as Anthropic's: an assistant's calls as `tool_use` blocks."""
    turns = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls is None:
            turns.append(message)
            continue
        blocks = [
            {
                "type": "tool_use",
                "id": c["id"],
                "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"]),
            }
            for c in calls
        ]
        turns.append({"role": "assistant", "content": blocks})
    return turns


def test_anthropic_tool_use_auto_and_forced_whole_and_streamed(claude: anthropic.Anthropic) -> None:
    tool = {
        "name": "get_weather",
        "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"],
    }
    berlin = _anthropic_turns([*FEW_SHOT, {"role": "user", "content": "Weather in Berlin?"}])
    auto = claude.messages.create(model=MODEL, max_tokens=60, messages=berlin, tools=[tool], extra_body=GREEDY)
    assert auto.stop_reason == "tool_use"
    (call,) = [b for b in auto.content if b.type == "tool_use"]
    assert (call.name, call.input) == ("get_weather", {"city": "Berlin"}) and call.id.startswith("toolu_")
    forced = {"type": "tool", "name": "get_weather"}
    whole = claude.messages.create(
        model=MODEL, max_tokens=40, messages=FRANCE, tools=[tool], tool_choice=forced, extra_body=GREEDY
    )
    (forced_call,) = whole.content
    assert forced_call.type == "tool_use" and set(forced_call.input) == {"city"} and whole.stop_reason == "tool_use"
    pieces = []
    with claude.messages.stream(
        model=MODEL, max_tokens=40, messages=FRANCE, tools=[tool], tool_choice=forced, extra_body=GREEDY
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert json.loads("".join(pieces)) == forced_call.input == final.content[0].input  # type: ignore[union-attr]


def test_the_lora_adapter_answers_differently_from_its_base(sdk: OpenAI) -> None:
    base = sdk.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=16)
    adapted = sdk.chat.completions.create(model=ADAPTER, messages=STORY, temperature=0, max_tokens=16)
    assert adapted.model == ADAPTER
    assert adapted.choices[0].message.content.startswith(STEERED)
    assert not base.choices[0].message.content.startswith(STEERED)


def test_vllms_refusals_are_400s_naming_the_parameter(sdk: OpenAI) -> None:
    cases = [
        (
            {"messages": [{"role": "user", "content": "hi " * 9000}], "max_tokens": 4},
            "messages",
            "context_length_exceeded",
        ),
        ({"messages": FRANCE, "logit_bias": {"60000": 5}}, "logit_bias", None),
        (
            {
                "messages": FRANCE,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
                },
            },
            "response_format",
            None,
        ),
    ]
    for body, param, code in cases:
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model=MODEL, **body)
        assert (info.value.param, info.value.code) == (param, code), info.value.message


def test_a_sessions_second_turn_comes_from_vllms_prefix_cache(sdk: OpenAI, gateway: Service, auth: dict) -> None:
    session = httpx.post(
        f"{gateway.url}/v1/sessions",
        headers=auth,
        json={"system_prompt": "You are a patient teacher. " + "Answer every question in full sentences. " * 40},
        timeout=10,
    ).json()
    first = sdk.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, extra_body={"session_id": session["id"]}
    )
    second = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "And of Italy?"}],
        temperature=0,
        max_tokens=8,
        extra_body={"session_id": session["id"]},
    )
    assert first.usage.prompt_tokens > 300
    assert second.usage.prompt_tokens_details.cached_tokens >= 256  # whole 128-token blocks of the first turn


def test_a_client_that_leaves_stops_its_sequence_within_a_step(sdk: OpenAI, vllm_worker: Service) -> None:
    # Cancelled by Axon (its job), and gone from vLLM's running batch.
    before = metric(vllm_worker, "axon_worker_jobs_total", model=MODEL, outcome="cancelled")
    stream = sdk.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=2000, extra_body={"ignore_eos": True}, stream=True
    )
    for received, _chunk in enumerate(stream):
        if received == 5:
            break
    stream.close()
    left_at = time.monotonic()
    while metric(vllm_worker, "axon_worker_jobs_total", model=MODEL, outcome="cancelled") <= before:
        assert time.monotonic() - left_at < 5, "the job was not cancelled"
        time.sleep(0.05)
    while metric(vllm_worker, "vllm:num_requests_running", engine="0", model_name=MODEL) > 0:
        assert time.monotonic() - left_at < 5, "vLLM still runs the request"  # its gauge: updated after a step
        time.sleep(0.05)


def test_vllms_own_metrics_are_on_the_workers_metrics(vllm_worker: Service, sdk: OpenAI) -> None:
    text = httpx.get(f"{vllm_worker.url}/metrics", headers=INTERNAL_AUTH, timeout=10).text
    scrape = Scrape(text)
    on_dashboards = {name for name in queried_metrics() if name.startswith("vllm:")}
    assert on_dashboards, "the worker dashboard has no vLLM panel"
    assert on_dashboards <= scrape.declared, on_dashboards - scrape.declared
    assert on_dashboards <= scrape.sampled, on_dashboards - scrape.sampled
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        assert f"\n{name}{{" in text, name
    assert metric(vllm_worker, "vllm:prompt_tokens_total", engine="0", model_name=MODEL) > 0
    assert "axon_worker_kv_cache_usage_ratio" in text


def test_the_bundled_model_was_converted_once_into_the_cache(
    vllm_model_cache: Path, cpu_model: Path, sdk: OpenAI
) -> None:
    """The bfloat16 copy, made from the float32 one (`vllm_model_cache`), holds the GGUF's weights
    as its loader casts them, and the same tokenizer, chat template and config; it is found, not
    made again."""
    (converted,) = [p for p in vllm_model_cache.iterdir() if not p.name.startswith(".") and p != cpu_model]
    files = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"}
    assert files <= {p.name for p in converted.iterdir()}
    for name in files - {"config.json", "model.safetensors"}:
        assert (converted / name).read_bytes() == (cpu_model / name).read_bytes(), name
    config, exact = (json.loads((d / "config.json").read_text()) for d in (converted, cpu_model))
    assert {k: v for k, v in config.items() if k != "dtype"} == {k: v for k, v in exact.items() if k != "dtype"}
    assert (config["dtype"], exact["dtype"]) == ("bfloat16", "float32")
    weights, exact_weights = (load_file(d / "model.safetensors") for d in (converted, cpu_model))
    assert weights.keys() == exact_weights.keys()
    for key, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, exact_weights[key].to(torch.bfloat16)), key
    began = time.monotonic()
    assert converted_model(bundled_gguf_path(), vllm_model_cache) == converted  # found, not converted again
    assert time.monotonic() - began < 2


def test_hostile_schemas_are_refused_or_answered_within_max_tokens_while_health_answers(
    sdk: OpenAI, vllm_worker: Service, gateway: Service, auth: dict
) -> None:
    """Issue 29 on vLLM: what no answer within max_tokens satisfies is refused at admission; the rest
    is generated within max_tokens by vLLM's xgrammar backend, but for a schema whose compile runs
    past AXON_GRAMMAR_COMPILE_TIMEOUT_S in the worker's probe: a 400, and vLLM never compiles it
    (it compiles one schema at a time with no limit: this one held every constrained request of
    the worker for 52 s), so a new schema right after it is answered at once."""
    with Sender(gateway, auth, MODEL) as sender, health_watched(vllm_worker) as health:
        for case in REFUSED:
            check(sender.send(case), case, "vllm")
        admitted = sender.send_together(ADMITTED, max_tokens=8)
        for case, response in zip(ADMITTED, admitted, strict=True):
            check(response, case, "vllm")
        began = time.monotonic()
        refusal = check(sender.send(TOO_COMPLEX), TOO_COMPLEX, "vllm")
        too_complex_s = time.monotonic() - began
        assert "too complex" in refusal["error"]["message"] and too_complex_s < 30
        check(sender.send(NOWHERE), NOWHERE, "vllm")
        began = time.monotonic()
        fresh = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        answer = sdk.chat.completions.create(
            model=MODEL,
            messages=FRANCE,
            response_format={"type": "json_schema", "json_schema": {"name": "fresh", "schema": fresh}},
            max_tokens=16,
        )
        next_schema_s = time.monotonic() - began
        assert answer.choices[0].finish_reason in {"stop", "length"} and next_schema_s < 30
    health.assert_answered_throughout()
    report(
        "hostile JSON schemas (vLLM engine)",
        refused_at_admission=len(REFUSED),
        answered_within_max_tokens=sum(response.status_code == 200 for response in admitted),
        refused_by_the_engine=[c.name for c, r in zip(ADMITTED, admitted, strict=True) if r.status_code == 400],
        too_complex_refused_in_s=round(too_complex_s, 1),
        next_new_schema_answered_in_s=round(next_schema_s, 1),
        health_asks=len(health.answers),
        health_slowest_ms=round(health.slowest_s * 1000, 1),
    )


def ended(sdk: OpenAI, batch_id: str, *, timeout_s: float) -> Batch:
    """The batch once it has ended (completed, failed, expired or cancelled)."""
    return wait_for(
        lambda: (batch := sdk.batches.retrieve(batch_id)).status in ENDED and batch,
        timeout_s=timeout_s,
        what=f"batch {batch_id} ended",
        interval_s=0.5,
    )


def test_a_small_batch_answers_each_line_as_the_same_request_online(sdk: OpenAI, checked: ContractTransport) -> None:
    """Issue 28 on the default engine: a batch's lines run on the module's vLLM worker and each
    answer is the one the same greedy request gets online; a line the endpoint refuses is its 400
    in the error file, the others complete."""
    # vLLM's CPU kernels are not batch-invariant: a greedy token's log probability moved by up to
    # 0.15 with what ran beside it, and most prompts of the bundled model have a near-tie early
    # ("What is the capital of France?" starts "The" at -1.75 against "L" at -2.0, and a batch line
    # answered "L'Éto"). Each line stops while every greedy choice led the next by 1.75 or more.
    asked = {
        "sky": ("What color is the sky on a clear day?", 6),
        "repeat": ("Repeat after me: the sky is blue.", 3),
        "hi": ("Hi!", 2),
    }
    answered = {
        name: {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": most}
        for name, (text, most) in asked.items()
    }
    refused = {"model": MODEL, "messages": FRANCE, "max_tokens": 8, "tool_choice": "sometimes"}
    lines = [*answered.items(), ("refused", refused)]
    jsonl = "".join(
        json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
        for custom_id, body in lines
    )
    upload = sdk.files.create(file=("batch.jsonl", jsonl.encode()), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    online = {custom_id: sdk.chat.completions.create(**body) for custom_id, body in answered.items()}
    with pytest.raises(openai.BadRequestError) as online_refusal:
        sdk.chat.completions.create(**refused)
    batch = ended(sdk, batch.id, timeout_s=120)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts is not None and batch.error_file_id
    counts = (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed)
    assert counts == (4, 3, 1), sdk.files.content(batch.error_file_id).text
    assert batch.output_file_id

    def read(file_id: str) -> dict[str, dict]:
        parsed = [json.loads(line) for line in sdk.files.content(file_id).text.splitlines() if line]
        by_id = {line["custom_id"]: line for line in parsed}
        assert len(by_id) == len(parsed)
        return by_id

    output, errors = read(batch.output_file_id), read(batch.error_file_id)
    assert (set(output), set(errors)) == (set(answered), {"refused"})
    for custom_id, line in output.items():
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        checked.check("CreateChatCompletionResponse", body, f"batch line {custom_id}")
        choice, same = body["choices"][0], online[custom_id].choices[0]
        assert (body["model"], choice["message"]["content"], choice["finish_reason"]) == (
            MODEL,
            same.message.content,
            same.finish_reason,
        )
        assert body["usage"]["completion_tokens"] == online[custom_id].usage.completion_tokens
    refusal = errors["refused"]["response"]
    checked.check("ErrorResponse", refusal["body"], "batch line refused")
    assert (refusal["status_code"], refusal["body"]["error"]["param"]) == (400, "tool_choice")
    assert online_refusal.value.param == "tool_choice"


def test_a_message_batch_answers_each_request_as_the_same_message_online(claude: anthropic.Anthropic) -> None:
    """Anthropic's Message Batches on the default engine: each request's Message is the one the same
    greedy request gets from `messages.create` (the prompts and lengths of the batch above, for the
    same reason: CPU kernels are not batch-invariant); one whose params the Messages API refuses is
    `errored` with that 400."""
    asked = {"sky": ("What color is the sky on a clear day?", 6), "hi": ("Hi!", 2)}
    params = {
        name: {"model": MODEL, "max_tokens": most, "messages": [{"role": "user", "content": text}], **GREEDY}
        for name, (text, most) in asked.items()
    }
    refused = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": FRANCE,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    requests = [
        *({"custom_id": k, "params": v} for k, v in params.items()),
        {"custom_id": "refused", "params": refused},
    ]
    batch = claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    online = {
        name: claude.messages.create(model=MODEL, max_tokens=most, messages=params[name]["messages"], extra_body=GREEDY)
        for name, (_, most) in asked.items()
    }
    batch = wait_for(
        lambda: (b := claude.messages.batches.retrieve(batch.id)).processing_status == "ended" and b,
        timeout_s=120,
        what=f"message batch {batch.id} ended",
        interval_s=0.5,
    )
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.canceled, counts.expired) == (2, 1, 0, 0)
    results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    assert set(results) == {*params, "refused"}
    for name, same in online.items():
        result = results[name]
        assert result.type == "succeeded"
        message = result.message
        assert (message.model, message.content, message.stop_reason) == (MODEL, same.content, same.stop_reason)
        assert message.usage.output_tokens == same.usage.output_tokens
    refusal = results["refused"]
    assert refusal.type == "errored" and refusal.error.error.type == "invalid_request_error"
    assert refusal.error.error.message.startswith("thinking")


def test_an_interactive_request_preempts_a_batch_line_on_vllm(sdk: OpenAI, vllm_worker: Service) -> None:
    """The worker's sequences all taken, batch lines among them: an interactive request takes one (a
    line's job is stopped in vLLM and handed back, outcome `preempted`) instead of waiting for a
    line to end, and every line still completes with its whole answer, resumed from its published
    tokens. (Word for word is not asked of vLLM here: its CPU answers are not batch-invariant.)

    It waits for no free sequence (running = the worker's maximum, read from its metrics, with a
    batch line among them), not for a count of batch lines: another job may hold a sequence. The
    lines (128 tokens, 20 for 16 sequences) run for seconds, so none ends between that reading and
    the request. The batch is cancelled if the test fails, so it does not hold the worker after."""
    most = 128
    body = {"model": MODEL, "messages": STORY, "temperature": 0, "max_tokens": most, "ignore_eos": True}
    jsonl = "".join(
        json.dumps({"custom_id": f"story-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
        for i in range(20)
    )
    upload = sdk.files.create(file=("batch.jsonl", jsonl.encode()), purpose="batch")
    preempted = metric(vllm_worker, "axon_worker_jobs_total", model=MODEL, outcome="preempted")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    try:
        full = metric(vllm_worker, "axon_worker_max_sequences", model=MODEL)
        wait_for(
            lambda: (
                metric(vllm_worker, "axon_worker_running_sequences", model=MODEL) >= full
                and metric(vllm_worker, "axon_worker_batch_sequences", model=MODEL) >= 1
            ),
            timeout_s=60,
            what=f"the worker's {full:.0f} sequences all running, a batch line among them",
        )
        answer = sdk.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=4)
        assert answer.choices[0].message.content
        assert metric(vllm_worker, "axon_worker_jobs_total", model=MODEL, outcome="preempted") > preempted
        batch = ended(sdk, batch.id, timeout_s=180)
    finally:
        if sdk.batches.retrieve(batch.id).status not in ENDED:
            sdk.batches.cancel(batch.id)
    assert batch.status == "completed" and batch.output_file_id, batch.errors
    output = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines() if line]
    assert sorted(line["custom_id"] for line in output) == sorted(f"story-{i}" for i in range(20))
    for line in output:
        answered = line["response"]["body"]
        assert answered["usage"]["completion_tokens"] == most, line["custom_id"]
        assert answered["choices"][0]["finish_reason"] == "length"
        assert len(answered["choices"][0]["message"]["content"].split()) > most // 4


# --- failing and stopping workers (last: they kill workers) -----------------------------------


def test_a_quiet_tenants_first_token_beside_a_burst_four_times_the_worker(
    sdk: OpenAI, vllm_worker: Service, gateway: Service, database_url: str
) -> None:
    """Fair share on the real vLLM (issue 36): a quiet tenant's time to first token beside another
    tenant's burst of 4 x the worker's sequences stays within 1.5 x its time beside a burst that
    just fills them (the engine's own cost of a full batch: no queue), in the same run."""
    limits = KeyLimits(rpm=1_000_000, tpm=100_000_000, max_concurrent=10_000)
    quiet_key, noisy_key = (
        asyncio.run(create_key(database_url, name=t, limits=limits, tenant=t)) for t in ("vllm-quiet", "vllm-noisy")
    )
    seqs = int(metric(vllm_worker, "axon_worker_max_sequences", model=MODEL))

    async def quiet_ttft_beside(streams: int) -> float:
        noisy = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=noisy_key, max_retries=0, timeout=120)
        quiet = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=quiet_key, max_retries=0, timeout=120)
        stop = asyncio.Event()

        async def first_token(client: AsyncOpenAI, max_tokens: int) -> float:
            started = time.perf_counter()
            ttft = 0.0
            stream = await client.chat.completions.create(
                model=MODEL, messages=STORY, max_tokens=max_tokens, stream=True, temperature=0
            )
            async for chunk in stream:
                if not ttft and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - started
            return ttft

        async def keep_going() -> None:
            while not stop.is_set():
                await first_token(noisy, 32)

        burst = [asyncio.create_task(keep_going()) for _ in range(streams)]
        await asyncio.sleep(3)  # the burst runs (and, at 4 x, queues)
        ttfts = [await first_token(quiet, 4) for _ in range(7)]
        stop.set()
        await asyncio.gather(*burst)
        return statistics.median(ttfts)

    full = asyncio.run(quiet_ttft_beside(seqs - 1))
    four_times = asyncio.run(quiet_ttft_beside(4 * seqs))
    report("quiet tenant's TTFT p50 on vLLM", seqs=seqs, beside_full_s=round(full, 3), beside_4x_s=round(four_times, 3))
    assert four_times <= 1.5 * full + 0.05, (full, four_times)


CITY = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "country": {"type": "string"}, "people": {"type": "integer"}},
            "required": ["name", "country", "people"],
        },
    },
}


# Words of English text, about 1.2 tokens each in SmolLM2's tokenizer.
VOCABULARY = (
    "the river town market bridge winter harvest council road school mill farmer teacher letter "
    "morning evening north south station garden library museum harbour ship storm record year"
).split()


def document(number: int, words: int = 800) -> str:
    """Document `number`: a text of its own (its first words say which), about 1,000 tokens."""
    rng = random.Random(number)
    return f"Document {number}. " + " ".join(rng.choice(VOCABULARY) for _ in range(words))


def test_one_shot_requests_about_documents_meet_them_in_vllm_workers_caches(
    workers: VllmWorkers, sdk: OpenAI, sessions: Service
) -> None:
    """vLLM's KV-cache events feed the prefix index: after a first round, each one-shot question
    about a document goes to the worker whose cache holds it (without the index, to any). Three
    workers: the two kill tests below take one each."""
    workers.at_least(3)
    wait_listed(sdk, MODEL)
    documents = [document(n) for n in range(4)]

    def ask(text: str, question: str) -> tuple[int, int]:
        content = f"{text}\n\nQuestion: {question}"
        answer = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2, temperature=0
        )
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        return answer.usage.prompt_tokens_details.cached_tokens or 0, answer.usage.prompt_tokens

    for text in documents:
        ask(text, "which town is it about?")
    routed = metric(sessions, "axon_sessions_prefix_routes_total", model=MODEL, reason="cached_prefix")
    second = [ask(text, "what happened in winter?") for text in documents]
    ratio = sum(c for c, _ in second) / sum(p for _, p in second)
    # Whole 128-token blocks of each ~1,000-token document (its last partial block and the new
    # question are computed again).
    assert ratio >= 0.75, second
    assert metric(sessions, "axon_sessions_prefix_routes_total", model=MODEL, reason="cached_prefix") - routed == 4


# vLLM's CPU kernels are not batch-invariant: the resume re-prefills the published tokens, and the
# next tokens' log probabilities come out a little different (up to 0.15 seen) from the
# uninterrupted run's decoding, so a near-tie after the kill can flip ("the small coastal town"
# resumed as "the small, coastal town"). The plain answer counts: each of its 48 greedy tokens
# leads the next choice by 1.0 or more, and from the fourth on by 1.75 or more (top_logprobs=2 on
# this engine). A constrained answer is generated again from the start (docs/architecture.md), as
# the reference was, so its near-ties are decided the same way.
@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "Count from 1 to 100."}], "max_tokens": 48},
        {"messages": [{"role": "user", "content": "Describe Paris."}], "max_tokens": 60, "response_format": CITY},
    ],
    ids=["plain", "json_schema"],
)
def test_a_worker_killed_mid_answer_is_resumed_word_for_word(workers: VllmWorkers, sdk: OpenAI, body: dict) -> None:
    reference = sdk.chat.completions.create(model=MODEL, temperature=0, **body).choices[0].message.content
    live = workers.at_least(2)
    wait_listed(sdk, MODEL)
    resumed = {w.port: metric(w, "axon_worker_jobs_total", model=MODEL, outcome="resumed") for w in live}
    victims: list[Service] = []

    def kill(victim: Service) -> None:
        victims.append(victim)
        victim.kill()

    assert stream_killing(sdk, workers, kill, model=MODEL, **body) == reference
    survivors = [w for w in live if w is not victims[0]]
    now = sum(metric(w, "axon_worker_jobs_total", model=MODEL, outcome="resumed") for w in survivors)
    assert now == sum(resumed[w.port] for w in survivors) + 1  # resumed once, by one of them
    no_process_left(workers.ids[victims[0].process.pid])


def test_a_stop_drains_the_answers_in_flight_then_exits_0(workers: VllmWorkers, sdk: OpenAI) -> None:
    (worker, *others) = workers.alive()
    for other in others:  # only this one may take the jobs
        assert other.stop() == 0
    results: list[tuple[str, int]] = []

    def ask() -> None:
        answer = sdk.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=40)
        results.append((answer.choices[0].finish_reason, answer.usage.completion_tokens))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    holder([worker], MODEL)
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(timeout=90) == 0
    for thread in threads:
        thread.join(timeout=30)
    assert results == [("length", 40)] * 2
    no_process_left(workers.ids[worker.process.pid])
