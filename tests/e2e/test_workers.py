"""Workers that never drop a request: failover mid-stream, drain, poison jobs, overload,
engine death, cancellation and zero-downtime model swaps, with real processes."""

import asyncio
import itertools
import signal
import threading
import time

import aio_pika
import httpx
import openai
import orjson
import pytest
from openai import OpenAI

from services.cli.launcher import Service
from shared.names import Names
from tests.e2e.stack import ADMIN_TOKEN, INTERNAL_AUTH, Stack
from tests.waiting import until, wait_for

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "tell me everything"}]


def metric(service: Service, name: str, **labels: str) -> float:
    text = httpx.get(f"{service.url}/metrics", headers=INTERNAL_AUTH, timeout=10).text
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def sim_worker(stack: Stack, name: str, model: str, **env: str) -> Service:
    return stack.start(f"worker:{name}", env={"AXON_ENGINE": "sim", "AXON_MODEL": model, **env})


def holder(workers: list[Service], model: str) -> Service:
    """The worker currently generating for `model`."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for worker in workers:
            if worker.process.poll() is None and metric(worker, "axon_worker_running_sequences", model=model) >= 1:
                return worker
        time.sleep(0.05)
    raise AssertionError("no worker is running the job")


def client_for(gateway: Service, api_key: str, **kwargs) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)


def wait_listed(client: OpenAI, model: str) -> None:
    """Until the session manager's live-model list (cached up to 1 s) includes `model`."""
    deadline = time.monotonic() + 5
    while model not in [m.id for m in client.models.list().data]:
        assert time.monotonic() < deadline, f"{model} not listed"
        time.sleep(0.1)


def test_worker_killed_mid_stream_the_stream_continues_without_gap_or_repeat(
    stack: Stack, gateway: Service, api_key: str
) -> None:
    model = "failover-sim"
    workers = [sim_worker(stack, f"failover-{i}", model, AXON_SIM_ITL_MS="20") for i in range(2)]
    client = client_for(gateway, api_key)
    wait_listed(client, model)
    expected = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120, seed=7)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120, seed=7, stream=True)
    pieces, arrivals = [], []
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        arrivals.append(time.monotonic())
        if len(pieces) == 30:
            holder(workers, model).kill()
        finish = chunk.choices[0].finish_reason
    assert "".join(pieces) == expected.choices[0].message.content
    assert finish == "length"
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    pause_s = max(gaps)
    print(f"\nfailover pause (sim): {pause_s * 1000:.0f} ms")
    assert pause_s < 5
    survivor = next(w for w in workers if w.process.poll() is None)
    assert metric(survivor, "axon_worker_jobs_total", model=model, outcome="resumed") == 1


def test_session_manager_killed_mid_stream_ends_the_stream_with_an_error_event(
    stack: Stack, api_key: str, sessions: Service
) -> None:
    victim = stack.start("sessions:mid-stream")
    gateway = stack.start("gateway:mid-stream", env={"AXON_SESSIONS_URL": victim.url})
    client = client_for(gateway, api_key)
    stream = client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=2000, stream=True)
    received = 0
    with pytest.raises(openai.APIError, match="interrupted"):
        for _chunk in stream:
            received += 1
            if received == 5:
                victim.kill()
                killed_at = time.monotonic()
    assert time.monotonic() - killed_at < 2


def test_sigterm_drains_in_flight_jobs_then_exits_0(stack: Stack, gateway: Service, api_key: str) -> None:
    model = "drain-sim"
    worker = sim_worker(stack, "drain", model, AXON_SIM_ITL_MS="10", AXON_DRAIN_TIMEOUT_S="10")
    client = client_for(gateway, api_key)
    wait_listed(client, model)
    results: list = []

    def ask() -> None:
        response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=300)
        results.append((response.choices[0].finish_reason, response.usage.completion_tokens))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    # All three running: a job still in the queue when the drain stops taking jobs waits there for
    # another worker of the model, and there is none.
    wait_for(
        lambda: metric(worker, "axon_worker_running_sequences", model=model) >= 3, timeout_s=10, what="three running"
    )
    worker.process.send_signal(signal.SIGTERM)
    ready = wait_for(
        lambda: (r := httpx.get(f"{worker.url}/ready", timeout=5)).status_code == 503 and r,
        timeout_s=5,
        what="the draining worker not ready",
    )
    assert "shutting down" in ready.json()["reason"]
    assert worker.process.wait(timeout=20) == 0
    for t in threads:
        t.join(timeout=20)
    assert results == [("length", 300)] * 3


def test_drain_timeout_hands_jobs_back_and_another_worker_finishes_them(
    stack: Stack, gateway: Service, api_key: str
) -> None:
    model = "handback-sim"
    first = sim_worker(stack, "handback-1", model, AXON_SIM_ITL_MS="10", AXON_DRAIN_TIMEOUT_S="0.5")
    client = client_for(gateway, api_key)
    wait_listed(client, model)
    results: list = []

    def ask() -> None:
        stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=300, seed=3, stream=True)
        results.append("".join(c.choices[0].delta.content or "" for c in stream))

    thread = threading.Thread(target=ask)
    thread.start()
    holder([first], model)
    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=15) == 0
    second = sim_worker(stack, "handback-2", model, AXON_SIM_ITL_MS="1")
    thread.join(timeout=30)
    wait_listed(client, model)
    expected = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=300, seed=3)
    assert results == [expected.choices[0].message.content]
    assert metric(second, "axon_worker_jobs_total", model=model, outcome="resumed") == 1


def test_job_that_keeps_killing_workers_is_dead_lettered_with_its_reason(
    stack: Stack, gateway: Service, api_key: str, namespace: str
) -> None:
    model = "poison-sim"
    env = {"AXON_SIM_ITL_MS": "20", "AXON_MAX_DELIVERIES": "2"}
    client = client_for(gateway, api_key)
    outcome: list = []
    worker = sim_worker(stack, "poison-0", model, **env)
    wait_listed(client, model)

    def ask() -> None:
        try:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2000, stream=True).response.read()
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    for attempt in range(1, 3):  # deliveries 1 and 2 each kill their worker
        holder([worker], model)
        worker.kill()
        worker = sim_worker(stack, f"poison-{attempt}", model, **env)
    thread.join(timeout=30)
    body = "".join(str(e) for e in outcome) if outcome else ""
    assert not thread.is_alive()
    assert metric(worker, "axon_worker_jobs_total", model=model, outcome="dead_lettered") == 1

    async def dead_letter_reason() -> str:
        connection = await aio_pika.connect(stack.amqp_url)
        channel = await connection.channel()
        queue = await channel.declare_queue(Names(namespace).dead_letter_queue, durable=True, passive=True)
        while (message := await queue.get(fail=False, timeout=5)) is not None:
            reason = (message.headers or {}).get("x-axon-dead-reason")
            await message.ack()
            # The namespace's dead-letter queue also holds other tests' poison jobs: only this model's counts.
            if reason and orjson.loads(message.body).get("model") == model:
                await connection.close()
                return reason
        await connection.close()
        return ""

    assert "delivered 3 times" in asyncio.run(dead_letter_reason())
    del body


def test_stream_of_a_dead_lettered_job_ends_with_an_error(stack: Stack, gateway: Service, api_key: str) -> None:
    model = "poison-stream-sim"
    env = {"AXON_SIM_ITL_MS": "20", "AXON_MAX_DELIVERIES": "1"}
    worker = sim_worker(stack, "poison-stream-0", model, **env)
    client = client_for(gateway, api_key)
    wait_listed(client, model)
    errors: list = []

    def ask() -> None:
        try:
            for _ in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2000, stream=True):
                pass
        except openai.APIError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=ask)
    thread.start()
    holder([worker], model)
    worker.kill()
    sim_worker(stack, "poison-stream-1", model, **env)
    thread.join(timeout=30)
    assert errors and "could not be completed" in errors[0]


def test_queue_cap_refuses_at_once_with_503(stack: Stack, api_key: str) -> None:
    own = {"AXON_NAMESPACE": f"{stack.namespace}-cap", "AXON_MAX_QUEUED_JOBS": "2"}
    sim_worker(stack, "cap", "cap-sim", **own, AXON_MAX_SEQS="1", AXON_SIM_ITL_MS="20")
    sessions = stack.start("sessions:cap", env=own)
    gateway = stack.start("gateway:cap", env={**own, "AXON_SESSIONS_URL": sessions.url})
    headers = {"Authorization": f"Bearer {api_key}"}
    body = {"model": "cap-sim", "messages": MESSAGES, "max_tokens": 100}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=30) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(6)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    refused = [r for r in responses if r.status_code == 503]
    # The queue holds 2; the worker may have taken one before the last publishes arrived.
    assert statuses.count(200) >= 2 and refused, statuses
    assert refused[0].json()["error"]["code"] == "queue_full" and refused[0].headers["retry-after"]
    assert refused[0].elapsed.total_seconds() < 1


def test_dead_engine_fails_health_and_exits_non_zero(stack: Stack, client: OpenAI) -> None:
    worker = sim_worker(stack, "doomed", "doomed-sim", AXON_SIM_FAIL_AFTER_S="1", AXON_HEARTBEAT_INTERVAL_S="0.5")
    assert worker.process.wait(timeout=15) != 0
    assert "engine_unhealthy" in worker.log_text()
    deadline = time.monotonic() + 3
    while "doomed-sim" in [m.id for m in client.models.list().data]:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_non_streaming_client_that_gives_up_cancels_its_job(
    gateway: Service, sim_worker: Service, api_key: str
) -> None:
    before = metric(sim_worker, "axon_worker_jobs_total", model="sim-model", outcome="cancelled")
    impatient = client_for(gateway, api_key).with_options(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=3000)
    deadline = time.monotonic() + 5
    while metric(sim_worker, "axon_worker_jobs_total", model="sim-model", outcome="cancelled") <= before:
        assert time.monotonic() < deadline, "the abandoned job was not cancelled"
        time.sleep(0.1)


def test_alias_switch_is_atomic_and_refuses_a_target_without_workers(
    stack: Stack, gateway: Service, api_key: str
) -> None:
    blue = sim_worker(stack, "blue", "model-blue", AXON_SIM_ITL_MS="2")
    green = sim_worker(stack, "green", "model-green", AXON_SIM_ITL_MS="2")
    admin = httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert admin.put("/admin/models/aliases/prod", json={"target": "model-blue"}).status_code == 200
    refused = admin.put("/admin/models/aliases/prod", json={"target": "model-nowhere"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "alias_target_unavailable"
    client = client_for(gateway, api_key)
    deadline = time.monotonic() + 3
    while "prod" not in [m.id for m in client.models.list().data]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    failures: list = []
    done = threading.Event()

    def load() -> None:
        while not done.is_set():
            try:
                client.chat.completions.create(model="prod", messages=MESSAGES, max_tokens=20)
            except Exception as exc:  # noqa: BLE001 - any failure counts
                failures.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(
        lambda: metric(blue, "axon_worker_jobs_total", model="model-blue", outcome="completed") >= 4,
        timeout_s=10,
        what="the load answered by model-blue",
    )
    assert admin.put("/admin/models/aliases/prod", json={"target": "model-green"}).status_code == 200
    # Switched once green answers and blue has nothing left in flight.
    wait_for(
        lambda: (
            metric(green, "axon_worker_jobs_total", model="model-green", outcome="completed") >= 4
            and metric(blue, "axon_worker_running_sequences", model="model-blue") == 0
        ),
        timeout_s=10,
        what="the load moved to model-green",
    )
    blue_after_switch = metric(blue, "axon_worker_jobs_total", model="model-blue", outcome="completed")
    time.sleep(1.0)  # the point: a second of load during which blue must answer nothing
    done.set()
    for t in threads:
        t.join(timeout=30)
    assert failures == []
    assert metric(green, "axon_worker_jobs_total", model="model-green", outcome="completed") > 0
    assert metric(blue, "axon_worker_jobs_total", model="model-blue", outcome="completed") == blue_after_switch
    assert admin.delete("/admin/models/aliases/prod").status_code == 200


async def _ready_in(stack: Stack, queue: str, count: int) -> bool:
    """Whether `queue` holds `count` or more messages ready for delivery."""
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        try:
            declared = await (await connection.channel()).declare_queue(queue, durable=True, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False  # not declared yet: nothing queued
        return (declared.declaration_result.message_count or 0) >= count


def test_higher_priority_keys_jump_the_queue(stack: Stack, database_url: str) -> None:
    from shared.keys import KeyLimits
    from tests.conftest import create_key

    # Priority orders a tenant's own jobs (between tenants, the fair share decides): two keys of
    # one tenant, whose jobs wait in its queue of the model.
    own = {"AXON_NAMESPACE": f"{stack.namespace}-prio"}
    queue = Names(own["AXON_NAMESPACE"]).tenant_queue("prio-sim", "prio")
    sim_worker(stack, "prio", "prio-sim", **own, AXON_MAX_SEQS="1", AXON_SIM_ITL_MS="5", AXON_SIM_TTFT_MS="0")
    sessions = stack.start("sessions:prio", env=own)
    gateway = stack.start("gateway:prio", env={**own, "AXON_SESSIONS_URL": sessions.url})
    low = asyncio.run(create_key(database_url, name="low", limits=KeyLimits(priority=0), tenant="prio"))
    high = asyncio.run(create_key(database_url, name="high", limits=KeyLimits(priority=9), tenant="prio"))
    finished: list[str] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:

            async def ask(key: str, label: str) -> None:
                r = await http.post(
                    "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": "prio-sim", "messages": MESSAGES, "max_tokens": 40},
                )
                assert r.status_code == 200
                finished.append(label)

            lows = [asyncio.create_task(ask(low, f"low{i}")) for i in range(6)]
            # One runs, the worker holds the next (taken ahead), four wait.
            await until(lambda: _ready_in(stack, queue, 4), timeout_s=10, what="the lows queued behind the first")
            await ask(high, "high")
            await asyncio.gather(*lows)

    asyncio.run(run())
    assert finished.index("high") <= 2, finished
