"""`n` choices through all three services (sim engine): one job per choice, fanned out by the
session manager and merged back, streamed with each choice's index, and OpenAI's shapes
throughout; completions' `echo` and `logprobs`."""

import asyncio
import time
import uuid

import asyncpg
import httpx
import pytest
from openai import OpenAI

from services.cli.launcher import Service
from tests.contract.openai_shapes import assert_openai_shape, assert_openai_stream
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.test_workers import metric

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Tell me three things."}]


def _chat(gateway: Service, auth: dict, **fields: object) -> httpx.Response:
    body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 6, **fields}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=auth, timeout=30)


def test_n_choices_are_independent_jobs_with_seed_plus_index(gateway: Service, auth: dict, database_url: str) -> None:
    response = _chat(gateway, auth, n=3, seed=40)
    assert response.status_code == 200, response.text
    body = response.json()
    assert_openai_shape("CreateChatCompletionResponse", body)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    # Choice i is what a single request with seed 40 + i answers.
    singles = [_chat(gateway, auth, seed=40 + i).json() for i in range(3)]
    assert [c["message"]["content"] for c in choices] == [s["choices"][0]["message"]["content"] for s in singles]
    assert len({c["message"]["content"] for c in choices}) == 3
    assert all(c["finish_reason"] == "length" and c["message"]["refusal"] is None for c in choices)
    # The answer counts the prompt once, as OpenAI's, and every choice's completion.
    prompt_tokens = singles[0]["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 3 * 6
    # The usage record (and the rate-limit charge) is what the platform did: one row for the
    # request, every job's prompt and completion.
    assert _usage_row(database_url, body["id"].removeprefix("chatcmpl-")) == (3 * prompt_tokens, 3 * 6)


def _usage_row(database_url: str, job_id: str) -> tuple[int, int] | None:
    async def fetch() -> tuple[int, int] | None:
        conn = await asyncpg.connect(database_url)
        try:
            row = await conn.fetchrow(
                "SELECT prompt_tokens, completion_tokens FROM usage WHERE job_id = $1", uuid.UUID(job_id)
            )
            return (row["prompt_tokens"], row["completion_tokens"]) if row else None
        finally:
            await conn.close()

    deadline = time.monotonic() + 10
    while (row := asyncio.run(fetch())) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return row


def test_n_choices_stream_merged_each_chunk_with_its_index(gateway: Service, auth: dict) -> None:
    whole = _chat(gateway, auth, n=3, seed=7).json()
    body = {
        "model": SIM_MODEL,
        "messages": MESSAGES,
        "max_tokens": 6,
        "n": 3,
        "seed": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=auth, timeout=30) as response:
        assert response.status_code == 200
        chunks = assert_openai_stream("CreateChatCompletionStreamResponse", response.iter_lines())
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    roles: dict[int, int] = {0: 0, 1: 0, 2: 0}
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for chunk in chunks[:-1]:
        assert chunk["id"] == chunks[0]["id"] and len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        index = choice["index"]
        if "role" in choice["delta"]:
            roles[index] += 1
            assert texts[index] == ""  # the role opens its choice
        texts[index] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[index].append(choice["finish_reason"])
    assert roles == {0: 1, 1: 1, 2: 1}
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 18


def test_a_client_that_leaves_cancels_every_choice(gateway: Service, sim_worker: Service, auth: dict) -> None:
    before = metric(sim_worker, "axon_worker_jobs_total", model=SIM_MODEL, outcome="cancelled")
    body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 4000, "n": 3, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=auth, timeout=30) as response:
        lines = response.iter_lines()
        seen: set[str] = set()
        while len(seen) < 3:  # every choice is under way
            line = next(lines)
            if line.startswith("data: {"):
                seen.add(line.split('"index":', 1)[1][:2])
    deadline = time.monotonic() + 10
    while metric(sim_worker, "axon_worker_jobs_total", model=SIM_MODEL, outcome="cancelled") < before + 3:
        assert time.monotonic() < deadline, "not every choice's job was cancelled"
        time.sleep(0.1)


def test_n_choices_over_the_limit_or_in_a_session_are_refused(client: OpenAI, gateway: Service, auth: dict) -> None:
    too_many = _chat(gateway, auth, n=9)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    session = httpx.post(f"{gateway.url}/v1/sessions", json={}, headers=auth, timeout=10).json()["id"]
    in_session = _chat(gateway, auth, n=2, session_id=session)
    assert in_session.status_code == 400 and in_session.json()["error"]["param"] == "n"


def test_completion_choices_with_echo_and_logprobs(client: OpenAI) -> None:
    prompt = "Once upon a time"
    completion = client.completions.create(
        model=SIM_MODEL, prompt=prompt, max_tokens=4, n=2, seed=5, echo=True, logprobs=2
    )
    body = completion.model_dump(mode="json", exclude_unset=True)
    assert_openai_shape("CreateCompletionResponse", body)
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.tokens and logprobs.text_offset and logprobs.top_logprobs
        assert logprobs.text_offset[0] == 0  # the prompt's tokens come first
        # Every token is where its offset says, in the text returned.
        for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
            assert choice.text[offset : offset + len(token)] == token
        assert all(len(top) <= 3 for top in logprobs.top_logprobs)  # the 2 most likely and the sampled one
    assert completion.usage is not None and completion.usage.completion_tokens == 8
