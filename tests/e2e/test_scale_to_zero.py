"""Scale to zero with real processes: a request for a model whose pool has no live worker is queued
for at most the model's cold-start wait (AXON_COLD_START_WAITS), streaming keep-alive comments
meanwhile, and completes once a worker starts; a wait of 0 keeps the immediate 503, and past the
wait the request is 503 and its job is skipped by the worker that starts later."""

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aio_pika
import httpx
import openai
import pytest
from openai import OpenAI

from services.cli.launcher import Service
from shared.names import Names
from tests.e2e.stack import Stack
from tests.e2e.test_workers import metric, sim_worker

pytestmark = pytest.mark.e2e

T = TypeVar("T")

MESSAGES = [{"role": "user", "content": "are you awake?"}]
WAITS = {"cold-sim": 60, "warm-sim": 60, "late-sim": 2, "slow-sim": 6, "zero-sim": 0}


@dataclass
class Cold:
    """A session manager and gateway of their own namespace, whose models have cold-start waits."""

    stack: Stack
    namespace: str
    sessions: Service
    gateway: Service
    api_key: str

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.gateway.url}/v1", api_key=self.api_key, max_retries=0, timeout=90)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway.url, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=90)

    def worker(self, model: str) -> Service:
        return sim_worker(self.stack, model, model, AXON_NAMESPACE=self.namespace)


@pytest.fixture(scope="module")
def cold(stack: Stack, api_key: str) -> Iterator[Cold]:
    """A session manager and gateway of a namespace of their own, stopped with the module (a session
    manager left running shares the run's database with later modules' and offers itself their
    batches)."""
    namespace = f"{stack.namespace}-cold"
    env = {"AXON_NAMESPACE": namespace, "AXON_COLD_START_WAITS": json.dumps(WAITS)}
    sessions = stack.start("sessions:cold", env=env)
    gateway = stack.start("gateway:cold", env={**env, "AXON_SESSIONS_URL": sessions.url})
    yield Cold(stack, namespace, sessions, gateway, api_key)
    gateway.stop()
    sessions.stop()


def _in_thread(target: Callable[[], T]) -> Callable[[], T]:
    """Run `target` in a thread now; the returned call joins it and gives its result (or raises)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = target()
        except Exception as exc:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()

    def join() -> T:
        thread.join(timeout=90)
        assert not thread.is_alive(), "the request never ended"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return join


def _queued(namespace: str, amqp_url: str, model: str) -> int:
    async def count() -> int:
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(Names(namespace).jobs_queue(model), passive=True)
            return queue.declaration_result.message_count or 0

    return asyncio.run(count())


def test_a_wait_of_zero_keeps_the_immediate_503_and_an_unlisted_model_is_404(cold: Cold) -> None:
    with cold.http() as http:
        started = time.monotonic()
        refused = http.post("/v1/chat/completions", json={"model": "zero-sim", "messages": MESSAGES})
        assert time.monotonic() - started < 2
        unknown = http.post("/v1/chat/completions", json={"model": "never-sim", "messages": MESSAGES})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker"
    assert refused.headers["retry-after"] == "5"
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_requests_wait_with_keepalives_for_a_worker_that_starts_5_s_later(cold: Cold) -> None:
    def sdk_stream() -> tuple[str, str | None]:
        stream = cold.client().chat.completions.create(model="cold-sim", messages=MESSAGES, max_tokens=6, stream=True)
        chunks = [c for c in stream if c.choices]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    def raw_stream() -> list[bytes]:
        body = {"model": "cold-sim", "messages": MESSAGES, "max_tokens": 3, "stream": True}
        with cold.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            return [line.encode() for line in response.iter_lines() if line]

    def unsupported() -> httpx.Response:
        # The model was never live: nothing is checked before it is queued; its worker refuses.
        body = {"model": "cold-sim", "messages": MESSAGES, "presence_penalty": 0.5}
        with cold.http() as http:
            return http.post("/v1/chat/completions", json=body)

    started = time.monotonic()
    sdk, raw, refused = _in_thread(sdk_stream), _in_thread(raw_stream), _in_thread(unsupported)
    time.sleep(5)
    cold.worker("cold-sim")
    text, finish_reason = sdk()
    lines = raw()
    assert time.monotonic() - started > 5
    assert text and finish_reason == "length"
    first_event = next(i for i, line in enumerate(lines) if not line.startswith(b":"))
    assert lines[:first_event] and all(line == b": keep-alive" for line in lines[:first_event]), lines[:3]
    assert lines[-1] == b"data: [DONE]"
    response = refused()
    assert response.status_code == 400, response.text
    assert "presence_penalty is not supported" in response.json()["error"]["message"]
    assert metric(cold.sessions, "axon_sessions_cold_start_waits_total", model="cold-sim", outcome="served") == 3


def test_past_the_wait_503_with_retry_after_and_the_late_worker_skips_the_job(cold: Cold) -> None:
    def raw(path: str, body: dict) -> list[bytes]:
        # slow-sim waits 6 s: its stream's head went out with the keep-alive at 5 s, so no 503.
        with cold.http() as http, http.stream("POST", path, json={**body, "model": "slow-sim", "stream": True}) as r:
            assert r.status_code == 200
            return [line.encode() for line in r.iter_lines() if line]

    chat = _in_thread(lambda: raw("/v1/chat/completions", {"messages": MESSAGES}))
    response = _in_thread(lambda: raw("/v1/responses", {"input": "hi"}))
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        cold.client().chat.completions.create(model="late-sim", messages=MESSAGES, max_tokens=4)
    waited_s = time.monotonic() - started
    assert refused.value.status_code == 503 and 2 <= waited_s < 10
    assert refused.value.response.headers["retry-after"] == "5"
    assert refused.value.code == "no_worker"
    assert _queued(cold.namespace, cold.stack.amqp_url, "late-sim") == 1  # it waits for the pool to wake
    lines = chat()
    assert lines[0] == b": keep-alive" and lines[-1] == b"data: [DONE]", lines
    assert json.loads(lines[-2].removeprefix(b"data: "))["error"]["code"] == "no_worker"
    events = [line.removeprefix(b"event: ") for line in response() if line.startswith(b"event: ")]
    assert events == [b"response.created", b"response.in_progress", b"response.failed"]

    worker = cold.worker("late-sim")
    deadline = time.monotonic() + 15
    while metric(worker, "axon_worker_jobs_total", model="late-sim", outcome="cancelled") < 1:
        assert time.monotonic() < deadline, "the late worker never took the job"
        time.sleep(0.2)
    assert metric(worker, "axon_worker_jobs_total", model="late-sim", outcome="completed") == 0
    assert _queued(cold.namespace, cold.stack.amqp_url, "late-sim") == 0
    # Polled with its queue (every AXON_QUEUE_POLL_INTERVAL_S, 5 s) once a worker served it: what keeps
    # AxonNoLiveWorker quiet.
    while metric(cold.sessions, "axon_sessions_cold_start_wait_seconds", model="late-sim") != 2:
        assert time.monotonic() < deadline + 10, "the cold-start wait is not exported"
        time.sleep(0.5)


def test_responses_wait_too_and_a_background_one_waits_past_a_wait_of_zero(cold: Cold) -> None:
    client = cold.client()

    def streamed() -> list[str]:
        events = client.responses.create(model="warm-sim", input="hi", max_output_tokens=4, stream=True)
        return [event.type for event in events]

    # zero-sim's wait is 0: a request is refused at once, a background response waits anyway.
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.create(model="zero-sim", input="hi", max_output_tokens=4)
    assert refused.value.status_code == 503
    background = client.responses.create(model="zero-sim", input="hi", max_output_tokens=4, background=True)
    assert background.status == "queued"
    events = _in_thread(streamed)
    time.sleep(5)
    cold.worker("warm-sim")
    cold.worker("zero-sim")
    types = events()
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete"), types
    deadline = time.monotonic() + 30
    while (done := client.responses.retrieve(background.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, done.status
        time.sleep(0.2)
    assert done.status in ("completed", "incomplete") and done.output_text
