"""Bad input, missing workers, deadlines and disconnects: explicit errors, never a hang."""

import re
import time

import httpx
import openai
import pytest
from openai import OpenAI

from services.cli.launcher import Service, free_port
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import INTERNAL_AUTH, INTERNAL_TOKEN, Stack

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "hello"}]
# What the gateway adds when it forwards to the (internal) session manager.
INTERNAL_HEADERS = {"x-axon-tenant": "tests", **INTERNAL_AUTH}


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def test_unknown_model_is_404_model_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"model": "sim-model", "messages": []}', "messages"),
        (b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "temperature": 9}', "temperature"),
        (b'{"model": "sim-model", "messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
        (b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "n": 9}', "n"),
    ],
)
def test_invalid_bodies_are_400_in_openai_shape(gateway: Service, auth: dict, body: bytes, param: str | None) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json", **auth},
        timeout=10,
    )
    error = _assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_oversized_body_is_413(gateway: Service, auth: dict) -> None:
    body = b'{"model": "sim-model", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    response = httpx.post(f"{gateway.url}/v1/completions", content=body, headers=auth, timeout=30)
    _assert_openai_error(response, 413)


@pytest.mark.parametrize(
    ("max_tokens", "param", "code"),
    [
        (-1, "max_tokens", "integer_below_min_value"),
        (0, "max_tokens", "integer_below_min_value"),
        # The simulator's context is 32768 tokens, AXON_MAX_TOKENS_LIMIT 8192.
        (10**6, "messages", "context_length_exceeded"),
        (10_000, "max_tokens", None),
    ],
)
def test_max_tokens_out_of_bounds_is_400_as_openai_answers_it(
    client: OpenAI, max_tokens: int, param: str, code: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=max_tokens)
    assert caught.value.body["type"] == "invalid_request_error"
    assert (caught.value.body["param"], caught.value.body["code"]) == (param, code)
    assert str(max_tokens) in caught.value.body["message"]


def test_max_tokens_over_the_context_of_a_completion_names_the_prompt(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=SIM_MODEL, prompt="hello", max_tokens=10**6)
    assert (caught.value.body["param"], caught.value.body["code"]) == ("prompt", "context_length_exceeded")


def test_killed_worker_leaves_models_within_15s_then_503_fast(
    stack: Stack, gateway: Service, client: OpenAI, auth: dict
) -> None:
    model = "ephemeral-model"
    worker = stack.start("worker:ephemeral", env={"AXON_ENGINE": "sim", "AXON_MODEL": model})
    listed_by = time.monotonic() + 3  # the session manager reuses the live list for up to 1 s
    while model not in [m.id for m in client.models.list().data]:
        assert time.monotonic() < listed_by, "a ready worker's model is not listed"
        time.sleep(0.1)
    worker.kill()
    killed_at = time.monotonic()
    while model in [m.id for m in client.models.list().data]:
        assert time.monotonic() - killed_at < 15, "killed worker's model still listed after 15 s"
        time.sleep(0.5)
    asked_at = time.monotonic()
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": model, "messages": MESSAGES}, headers=auth, timeout=10
    )
    assert time.monotonic() - asked_at < 5
    error = _assert_openai_error(response, 503)
    assert error["code"] == "no_worker"
    assert int(response.headers["retry-after"]) > 0


@pytest.fixture(scope="module")
def short_deadline_sessions(stack: Stack) -> Service:
    """A second session manager whose requests expire after 1 s, and slow sim workers behind it."""
    stack.start("worker:slow-start", env={"AXON_ENGINE": "sim", "AXON_MODEL": "slow-start", "AXON_SIM_TTFT_MS": "3000"})
    stack.start(
        "worker:slow-tail",
        env={"AXON_ENGINE": "sim", "AXON_MODEL": "slow-tail", "AXON_SIM_TTFT_MS": "0", "AXON_SIM_ITL_MS": "400"},
    )
    return stack.start("sessions:short", env={"AXON_REQUEST_TIMEOUT_S": "1"})


@pytest.mark.parametrize("stream", [False, True])
def test_deadline_before_first_token_is_504(short_deadline_sessions: Service, stream: bool) -> None:
    started = time.monotonic()
    response = httpx.post(
        f"{short_deadline_sessions.url}/v1/chat/completions",
        json={"model": "slow-start", "messages": MESSAGES, "max_tokens": 3, "stream": stream},
        headers=INTERNAL_HEADERS,
        timeout=10,
    )
    assert time.monotonic() - started < 3
    error = _assert_openai_error(response, 504)
    assert error["type"] == "timeout_error"


def test_deadline_mid_stream_ends_with_an_error_event(short_deadline_sessions: Service) -> None:
    client = OpenAI(
        base_url=f"{short_deadline_sessions.url}/v1",
        api_key=INTERNAL_TOKEN,  # the client's own bearer header carries the internal token
        max_retries=0,
        timeout=10,
        default_headers=INTERNAL_HEADERS,
    )
    stream = client.chat.completions.create(model="slow-tail", messages=MESSAGES, max_tokens=20, stream=True)
    received = []
    with pytest.raises(openai.APIError, match="deadline"):
        for chunk in stream:
            received.append(chunk)
    assert received, "the stream should have started before the deadline"


def test_session_manager_down_is_503_and_not_ready(stack: Stack, auth: dict) -> None:
    lonely = stack.start(
        "gateway:lonely", env={"AXON_SESSIONS_URL": f"http://127.0.0.1:{free_port()}"}, ready_path="/health"
    )
    response = httpx.post(
        f"{lonely.url}/v1/chat/completions", json={"model": SIM_MODEL, "messages": MESSAGES}, headers=auth, timeout=10
    )
    _assert_openai_error(response, 503)
    assert response.headers["retry-after"]
    ready = httpx.get(f"{lonely.url}/ready", timeout=10)
    assert ready.status_code == 503 and "session manager" in ready.json()["reason"]


def _cancelled_jobs(worker: Service) -> float:
    text = httpx.get(f"{worker.url}/metrics", headers=INTERNAL_AUTH, timeout=5).text
    match = re.search(r'axon_worker_jobs_total\{model="sim-model",outcome="cancelled"\} ([0-9.]+)', text)
    return float(match.group(1)) if match else 0.0


def test_client_disconnect_cancels_generation_on_the_worker(gateway: Service, sim_worker: Service, auth: dict) -> None:
    before = _cancelled_jobs(sim_worker)
    body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=auth, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
    deadline = time.monotonic() + 5
    while _cancelled_jobs(sim_worker) <= before:
        assert time.monotonic() < deadline, "the worker did not abort the abandoned stream"
        time.sleep(0.1)
