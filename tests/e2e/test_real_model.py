"""The real CPU engine (transformers + the bundled SmolLM2 GGUF) behind the full stack (with issue
29's hostile schemas: refused, or answered within max_tokens, while the worker's /health answers)."""

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest
from openai import AsyncOpenAI, OpenAI

from services.cli.launcher import Service
from tests.e2e.conftest import FRANCE
from tests.e2e.hostile_schemas import ADMITTED, NOWHERE, REFUSED, TOO_COMPLEX, Sender, check, health_watched
from tests.e2e.load import report
from tests.e2e.stack import Stack
from tests.e2e.test_workers import holder, wait_listed

# `alone` (make test runs it with no other test beside it): the real model keeps both cores busy.
pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.alone]

MODEL = "smollm2-transformers"  # the default name is the default engine's (vLLM: test_vllm_engine.py)


@pytest.fixture(scope="module")
def workers() -> Iterator[list[Service]]:
    """This module's workers, stopped with it: their 2 GB each are not the later modules' to share."""
    started: list[Service] = []
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture(scope="module")
def model_worker(stack: Stack, workers: list[Service]) -> Service:
    workers.append(
        stack.start(
            "worker:smollm2",
            env={"AXON_ENGINE": "transformers", "AXON_MODEL": MODEL, "AXON_MAX_SEQS": "8"},
            ready_timeout_s=240,
        )
    )
    return workers[-1]


@pytest.fixture
def model_client(model_worker: Service, gateway: Service, api_key: str) -> OpenAI:
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=120)
    wait_listed(client, MODEL)  # the session manager reuses its live-model list for up to 1 s
    return client


def test_capital_of_france_is_paris_streaming_and_not(model_client: OpenAI) -> None:
    whole = model_client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=32)
    assert "Paris" in whole.choices[0].message.content
    assert whole.choices[0].finish_reason in {"stop", "length"}
    assert 0 < whole.usage.completion_tokens <= 32
    assert whole.usage.prompt_tokens > 10  # the chat template wraps the question
    stream = model_client.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy decoding is deterministic
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_max_tokens_and_stop_are_honoured(model_client: OpenAI) -> None:
    short = model_client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3)
    assert short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 3
    cut = model_client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=32, stop=["Paris"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert "Paris" not in cut.choices[0].message.content


def test_text_completion_continues_the_prompt(model_client: OpenAI) -> None:
    response = model_client.completions.create(model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=8)
    assert response.choices[0].text.strip()
    assert response.usage.completion_tokens <= 8


async def test_concurrent_requests_all_complete(model_client: OpenAI, gateway: Service, api_key: str) -> None:
    client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=120)
    prompts = [f"Count from {i} to {i + 5}." for i in range(6)]
    responses = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], temperature=0.7, max_tokens=16
            )
            for p in prompts
        )
    )
    assert all(r.choices[0].message.content for r in responses)
    assert all(r.usage.completion_tokens <= 16 for r in responses)


def test_hostile_schemas_are_refused_or_answered_within_max_tokens_while_health_answers(
    model_client: OpenAI, model_worker: Service, gateway: Service, auth: dict
) -> None:
    """Issue 29 on the CPU engine: what no answer within max_tokens satisfies is refused at
    admission; the rest is generated within max_tokens by xgrammar, but for a schema whose compile
    runs past AXON_GRAMMAR_COMPILE_TIMEOUT_S in the probe: a 400 within that time, the probe killed."""
    with Sender(gateway, auth, MODEL) as sender, health_watched(model_worker) as health:
        for case in REFUSED:
            check(sender.send(case), case, "transformers")
        admitted = sender.send_together(ADMITTED, max_tokens=8)
        for case, response in zip(ADMITTED, admitted, strict=True):
            check(response, case, "transformers")
        began = time.monotonic()
        refusal = check(sender.send(TOO_COMPLEX), TOO_COMPLEX, "transformers")
        too_complex_s = time.monotonic() - began
        assert "too complex" in refusal["error"]["message"] and too_complex_s < 30
        check(sender.send(NOWHERE), NOWHERE, "transformers")
    health.assert_answered_throughout()
    report(
        "hostile JSON schemas (CPU engine)",
        refused_at_admission=len(REFUSED),
        answered_within_max_tokens=sum(response.status_code == 200 for response in admitted),
        refused_by_the_engine=[c.name for c, r in zip(ADMITTED, admitted, strict=True) if r.status_code == 400],
        too_complex_refused_in_s=round(too_complex_s, 1),
        health_asks=len(health.answers),
        health_slowest_ms=round(health.slowest_s * 1000, 1),
    )


def test_failover_mid_stream_with_the_real_engine_at_temperature_0(
    stack: Stack, model_worker: Service, model_client: OpenAI, workers: list[Service]
) -> None:
    second = stack.start(
        "worker:smollm2-b",
        env={"AXON_ENGINE": "transformers", "AXON_MODEL": MODEL, "AXON_MAX_SEQS": "8"},
        ready_timeout_s=240,
    )
    workers.append(second)
    story = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    reference = model_client.chat.completions.create(model=MODEL, messages=story, temperature=0, max_tokens=48)
    stream = model_client.chat.completions.create(
        model=MODEL, messages=story, temperature=0, max_tokens=48, stream=True
    )
    pieces, arrivals = [], []
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        arrivals.append(time.monotonic())
        if len(pieces) == 8:
            holder([model_worker, second], MODEL).kill()
    assert "".join(pieces) == reference.choices[0].message.content
    pause_s = max(b - a for a, b in itertools.pairwise(arrivals))
    print(f"\nfailover pause (SmolLM2 CPU): {pause_s * 1000:.0f} ms")


def test_completions_echo_with_logprobs_scores_the_prompt_too(model_client: OpenAI) -> None:
    prompt = "The capital of France is"
    plain = model_client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4, logprobs=2)
    echoed = model_client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=4, logprobs=2, echo=True
    )
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    tokens, answer_tokens = choice.logprobs.tokens, plain.choices[0].logprobs.tokens
    assert tokens[len(tokens) - len(answer_tokens) :] == answer_tokens
    prompt_part = tokens[: len(tokens) - len(answer_tokens)]
    assert prompt_part and prompt.endswith("".join(prompt_part))  # every prompt token but the first
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs)
