"""Tensor parallelism on this CPU, vLLM's engine core killed alone, and a start that fails after vLLM
loaded, with real vLLM workers through the whole stack.

A small Llama with random weights is made here (float32, 8 attention heads, the bundled
tokenizer): quick to load and split in two. Two workers serve it under one name, one with
`AXON_TENSOR_PARALLEL_SIZE=2` (two CPU ranks, one core each, over gloo) and one without:

- tensor parallel 2 gives the greedy tokens of 1: the same prompts, sent so that both workers
  answer, give the same tokens whoever answers (float32: in bfloat16 the split changes the sums'
  rounding, and the tokens with it);
- vLLM's engine-core process killed alone mid-answer: its worker hands the job back and exits 1,
  the other worker resumes it, the client's text is an uninterrupted run's, and no process of the
  dead worker is left;
- a worker whose tool parser does not fit the model (mistral's, without its `[TOOL_CALLS]` token)
  fails its start after vLLM loaded, exits 1, and leaves no vLLM process behind.

(Pipeline parallelism is refused on the CPU before vLLM loads: tests/unit/worker/test_vllm_boundary.py.)
"""

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from services.cli.launcher import Service, ServiceExited
from tests.e2e.stack import Stack
from tests.e2e.test_workers import client_for, metric, wait_listed
from tests.e2e.vllm import VllmWorkers, engine_core_of, no_process_left, stream_killing
from tests.models import random_llama

# `alone` (make test runs it with no other test beside it):
# vLLM (two engines, one a tensor-parallel pair) keeps both cores busy.
pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.timeout(300), pytest.mark.alone]

MODEL = "tiny-llama"
PROMPTS = ["Hello there", "The capital of France is", "One, two, three,"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def workers(stack: Stack, tiny: Path) -> Iterator[VllmWorkers]:
    pool = VllmWorkers(stack, MODEL, {"AXON_MODEL": MODEL, "AXON_MODEL_PATH": str(tiny), "AXON_DTYPE": "float32"})
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def pair(workers: VllmWorkers) -> list[Service]:
    one, two = workers.start_together({}, {"AXON_TENSOR_PARALLEL_SIZE": "2"})
    assert '"threads_bind":"0|1"' in two.log_text()  # one core per rank
    assert '"threads_bind":"0-1"' in one.log_text()
    return [one, two]


@pytest.fixture(scope="module")
def client(pair: list[Service], gateway: Service, api_key: str) -> OpenAI:
    client = client_for(gateway, api_key)
    wait_listed(client, MODEL)
    return client


def test_tensor_parallel_2_gives_the_greedy_tokens_of_1(pair: list[Service], client: OpenAI) -> None:
    answered = {w.port: metric(w, "axon_worker_jobs_total", model=MODEL, outcome="completed") for w in pair}
    tokens: dict[str, set[tuple[str, ...]]] = {}
    for _ in range(3):  # each prompt twice or more: the queue deals the jobs to both workers
        for prompt in PROMPTS:
            answer = client.completions.create(
                model=MODEL, prompt=prompt, temperature=0, max_tokens=16, logprobs=0, extra_body={"ignore_eos": True}
            )
            tokens.setdefault(prompt, set()).add(tuple(answer.choices[0].logprobs.tokens))
    assert all(len(answers) == 1 and len(next(iter(answers))) == 16 for answers in tokens.values()), tokens
    for worker in pair:  # both answered: tensor parallel 2 and 1 gave the same tokens
        assert metric(worker, "axon_worker_jobs_total", model=MODEL, outcome="completed") > answered[worker.port]


def test_a_dead_engine_core_fails_its_worker_and_the_answer_resumes(
    workers: VllmWorkers, pair: list[Service], client: OpenAI
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 64}
    reference = client.chat.completions.create(temperature=0, extra_body={"ignore_eos": True}, **body)
    victims: list[Service] = []

    def kill_engine_core(victim: Service) -> None:
        victims.append(victim)
        os.kill(engine_core_of(victim), signal.SIGKILL)

    text = stream_killing(client, workers, kill_engine_core, extra_body={"ignore_eos": True}, **body)
    assert text == reference.choices[0].message.content
    victim = victims[0]
    assert victim.process.wait(timeout=60) == 1
    assert "job_engine_died" in victim.log_text() or "engine_unhealthy" in victim.log_text()
    (survivor,) = [w for w in pair if w is not victim]
    assert metric(survivor, "axon_worker_jobs_total", model=MODEL, outcome="resumed") == 1
    no_process_left(workers.ids[victim.process.pid])


def test_a_failed_start_leaves_no_vllm_process_behind(stack: Stack, tiny: Path) -> None:
    unfit = VllmWorkers(
        stack,
        "tiny-unfit-parser",
        # mistral's parser needs its [TOOL_CALLS] token, which the bundled tokenizer does not have
        {"AXON_MODEL": "tiny-unfit-parser", "AXON_MODEL_PATH": str(tiny), "AXON_TOOL_PARSER": "mistral"},
    )
    with pytest.raises(ServiceExited) as info:
        unfit.start()
    worker = info.value.service
    assert worker.exit_code == 1
    assert "does not fit the model" in worker.log_text()
    no_process_left(unfit.worker_ids[-1])
