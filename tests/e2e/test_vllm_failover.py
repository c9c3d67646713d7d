"""Real vLLM workers failing, stopping and splitting a model, through the whole stack.

- A worker killed (-9) mid-answer: another resumes the job and the client's stream is the answer
  an uninterrupted run gives, word for word (plain, and constrained by a JSON schema).
- vLLM's engine-core process killed alone: the worker reports itself unhealthy and exits, its
  answer resumes on another worker, and nothing of it is left running.
- A stop (SIGTERM) drains: the answers in flight finish, then the worker exits 0.
- A worker whose start fails after vLLM loaded (a tool parser that does not fit the model) exits
  non-zero and leaves no vLLM process behind.
- Tensor parallelism 2 (two CPU ranks, one core each) gives the greedy tokens of 1, on a small
  random Llama made here; pipeline parallelism is refused on the CPU at start.

The workers run in float32, where the greedy tokens do not depend on how a batch or a resumed
prompt is cut (they may in bfloat16). Workers of models of this module's own, so no other
module's worker takes these jobs.
"""

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from services.cli.launcher import Service, ServiceExited
from services.worker.engines.gguf import bundled_gguf_path
from tests.e2e.stack import Stack
from tests.e2e.test_workers import client_for, holder, metric, wait_listed
from tests.models import random_llama

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.timeout(600)]

MODEL = "smollm2-failover"
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
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
PARIS = [{"role": "user", "content": "Describe Paris, the capital of France."}]


class Pool:
    """This module's workers of MODEL; `two()` starts workers until two are alive."""

    def __init__(self, stack: Stack, cache: Path) -> None:
        self._stack = stack
        self._cache = cache
        self.workers: list[Service] = []
        # Each worker's AXON_WORKER_ID, by its pid: its processes carry it in their environment.
        self.ids: dict[int, str] = {}

    def start(self) -> Service:
        worker_id = f"failover-{uuid.uuid4().hex[:8]}"
        worker_env = {
            "AXON_MODEL": MODEL,
            "AXON_MODEL_PATH": str(bundled_gguf_path()),
            "AXON_MODEL_CACHE_DIR": str(self._cache),
            "AXON_DTYPE": "float32",
            "AXON_MAX_SEQS": "4",
            "AXON_WORKER_ID": worker_id,
        }
        worker = self._stack.start(f"worker:{MODEL}-{len(self.workers)}", env=worker_env, ready_timeout_s=300)
        self.workers.append(worker)
        self.ids[worker.process.pid] = worker_id
        return worker

    def alive(self) -> list[Service]:
        return [w for w in self.workers if w.process.poll() is None]

    def two(self) -> list[Service]:
        while len(self.alive()) < 2:
            self.start()
        return self.alive()


@pytest.fixture(scope="module")
def pool(stack: Stack, vllm_model_cache: Path) -> Pool:
    return Pool(stack, vllm_model_cache)


@pytest.fixture(scope="module")
def client(pool: Pool, gateway: Service, api_key: str) -> OpenAI:
    pool.two()
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=180)
    wait_listed(client, MODEL)
    return client


def processes_of(worker_id: str) -> list[int]:
    """Processes whose environment names this worker id: the worker and every process it started."""
    found = []
    marker = f"AXON_WORKER_ID={worker_id}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if marker in environ.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def engine_core_of(worker: Service) -> int:
    """The pid of the worker's vLLM engine-core child process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/comm") as comm:
                    name = comm.read().strip()
            except OSError:
                continue
            if int(fields[1]) == worker.process.pid and name.startswith("VLLM::EngineCor"):
                return int(entry)
    raise AssertionError("no engine-core process")


def stream_killing(client: OpenAI, kill: Callable[[], None], **body: Any) -> str:
    """Stream an answer, calling `kill()` after its 8th chunk; returns the whole text received."""
    pieces = []
    for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **body):
        pieces.append(chunk.choices[0].delta.content or "")
        if len(pieces) == 8:
            kill()
    return "".join(pieces)


@pytest.mark.parametrize(
    "body",
    [{"messages": STORY, "max_tokens": 48}, {"messages": PARIS, "max_tokens": 60, "response_format": CITY}],
    ids=["plain", "json_schema"],
)
def test_a_worker_killed_mid_answer_is_resumed_word_for_word(pool: Pool, client: OpenAI, body: dict) -> None:
    reference = client.chat.completions.create(model=MODEL, temperature=0, **body).choices[0].message.content
    workers = pool.two()
    resumed = {w.port: metric(w, "axon_worker_jobs_total", model=MODEL, outcome="resumed") for w in workers}
    victims: list[Service] = []

    def kill() -> None:
        victims.append(holder(workers, MODEL))
        victims[0].kill()

    assert stream_killing(client, kill, **body) == reference
    survivor = next(w for w in workers if w is not victims[0])
    assert metric(survivor, "axon_worker_jobs_total", model=MODEL, outcome="resumed") == resumed[survivor.port] + 1
    if "response_format" in body:
        json.loads(reference)
    no_process_left(pool.ids[victims[0].process.pid])  # vLLM's engine core would outlive it: orphans.py


def test_a_dead_engine_core_fails_its_worker_and_the_answer_resumes(pool: Pool, client: OpenAI) -> None:
    reference = client.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=48)
    workers = pool.two()
    victims: list[Service] = []

    def kill_engine_core() -> None:
        victims.append(holder(workers, MODEL))
        os.kill(engine_core_of(victims[0]), signal.SIGKILL)

    assert (
        stream_killing(client, kill_engine_core, messages=STORY, max_tokens=48) == reference.choices[0].message.content
    )
    victim = victims[0]
    assert victim.process.wait(timeout=60) != 0
    log = victim.log_text()
    assert "job_engine_died" in log or "engine_unhealthy" in log
    no_process_left(pool.ids[victim.process.pid])


def no_process_left(worker_id: str) -> None:
    deadline = time.monotonic() + 15
    while processes_of(worker_id):
        assert time.monotonic() < deadline, "vLLM processes of a worker that exited are still running"
        time.sleep(0.2)


def test_a_stop_drains_the_answers_in_flight_then_exits_0(pool: Pool, client: OpenAI) -> None:
    (worker, *others) = pool.alive()
    for other in others:  # only this one may take the jobs
        other.process.send_signal(signal.SIGTERM)
        assert other.process.wait(timeout=60) == 0
    results: list[tuple[str, int]] = []

    def ask() -> None:
        answer = client.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=40)
        results.append((answer.choices[0].finish_reason, answer.usage.completion_tokens))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    holder([worker], MODEL)
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(timeout=90) == 0
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(results) == [("length", 40)] * 2


def test_a_failed_start_leaves_no_vllm_process_behind(stack: Stack, vllm_model_cache: Path) -> None:
    worker_id = f"failover-{uuid.uuid4().hex[:8]}"
    env = {
        "AXON_MODEL": "smollm2-unfit-parser",
        "AXON_MODEL_PATH": str(bundled_gguf_path()),
        "AXON_MODEL_CACHE_DIR": str(vllm_model_cache),
        "AXON_TOOL_PARSER": "mistral",  # its [TOOL_CALLS] token is not in SmolLM2's vocabulary
        "AXON_WORKER_ID": worker_id,
    }
    with pytest.raises(ServiceExited) as info:
        stack.start("worker:unfit-parser", env=env, ready_timeout_s=300)
    assert info.value.service.exit_code != 0
    assert "does not fit the model" in info.value.service.log_text()
    no_process_left(worker_id)


def test_tensor_parallel_2_gives_the_greedy_tokens_of_1(
    stack: Stack, gateway: Service, api_key: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = random_llama(tmp_path_factory.mktemp("tiny-llama"))
    base = {"AXON_MODEL_PATH": str(folder), "AXON_DTYPE": "float32", "AXON_MAX_SEQS": "4"}
    one = stack.start("worker:tiny-tp1", env={**base, "AXON_MODEL": "tiny-tp1"}, ready_timeout_s=300)
    two = stack.start(
        "worker:tiny-tp2", env={**base, "AXON_MODEL": "tiny-tp2", "AXON_TENSOR_PARALLEL_SIZE": "2"}, ready_timeout_s=300
    )
    assert '"threads_bind":"0|1"' in two.log_text()  # one core per rank
    client = client_for(gateway, api_key)
    for model in ("tiny-tp1", "tiny-tp2"):
        wait_listed(client, model)
    for prompt in ("Hello there", "The capital of France is", "One, two, three,"):
        tokens = [
            client.completions.create(
                model=model, prompt=prompt, temperature=0, max_tokens=16, logprobs=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .logprobs.tokens
            for model in ("tiny-tp1", "tiny-tp2")
        ]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 16
    for worker in (one, two):
        assert worker.stop() == 0


def test_pipeline_parallelism_is_refused_on_the_cpu_before_vllm_loads(stack: Stack) -> None:
    env = {"AXON_MODEL": "tiny-pp2", "AXON_PIPELINE_PARALLEL_SIZE": "2", "AXON_ENGINE": "vllm"}
    with pytest.raises(ServiceExited) as info:
        stack.start("worker:tiny-pp2", env=env, ready_timeout_s=120)
    assert "no pipeline parallelism" in info.value.service.log_text()
