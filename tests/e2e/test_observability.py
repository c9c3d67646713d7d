"""Observability through the running stack: every metric a dashboard panel or an alert rule
queries is exported, logs correlate one request across services, and never carry a key.
"""

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import aio_pika
import httpx
import pytest
import redis
from openai import OpenAI

from services.cli.launcher import Service
from shared.keys import KeyLimits
from shared.names import Names
from tests.conftest import create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import ADMIN_TOKEN, INTERNAL_AUTH, Stack
from tests.e2e.test_workers import client_for, wait_listed
from tests.metric_names import SYNTHETIC_METRICS, Scrape, queried_metric_jobs, queried_metrics
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

# Worker metrics the dashboards and alerts already query but the worker does not export yet.
# Skipped by the existence check; remove a name as soon as the worker exports it (the test fails
# while an exported metric is still listed, so this list can only shrink).
PENDING_WORKER_METRICS: frozenset[str] = frozenset()
# Given a series only by a worker that has a GPU (vLLM engine); the e2e stack runs the sim engine.
GPU_ONLY_METRICS = frozenset({"axon_worker_gpu_memory_used_bytes"})
# vLLM's own (`vllm:*`), served only by workers on the vLLM engine: checked against the run's real
# vLLM worker in tests/e2e/test_vllm_engine.py.
VLLM_METRICS = frozenset(name for name in queried_metrics() if name.startswith("vllm:"))
# Declared by the code but only given a series when something fails (here: Redis unreachable
# from the gateway, a gap in a worker's KV-cache events), which this test does not cause.
ONLY_ON_FAILURE = frozenset({"axon_gateway_rate_limiter_unavailable_total", "axon_worker_kv_event_gaps_total"})
# Series only a request waiting for a cold pool makes: the shared stack has no cold-start wait
# (tests/e2e/test_scale_to_zero.py reads them).
ONLY_ON_COLD_START = frozenset({"axon_sessions_cold_start_waiting", "axon_sessions_cold_start_waits_total"})

JOBS = {"gateway": "gateway", "sessions": "sessions", "worker:sim": "worker"}
# The tenant of the `api_key` fixture's key.
TENANT = "tests"


def _chat(gateway: Service, key: str, *, request_id: str | None = None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({"x-request-id": request_id} if request_id else {})}
    payload = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "observe"}], "max_tokens": 4, **body}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=payload, headers=headers, timeout=30)


def _scrape(service: Service) -> Scrape:
    response = httpx.get(f"{service.url}/metrics", headers=INTERNAL_AUTH, timeout=10)
    assert response.status_code == 200, service.name
    return Scrape(response.text)


def _eventually(check: Callable[[], bool], *, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, message
        time.sleep(0.25)


@pytest.fixture(scope="module")
def traffic(stack: Stack, gateway: Service, sessions: Service, database_url: str, api_key: str) -> dict:
    """Every kind of request the dashboards and alerts count: chat and text completions, streamed
    and not, two turns of a session, a 401, a 429, a 404 model, a batch. Returns what the checks need."""
    auth = {"Authorization": f"Bearer {api_key}"}
    assert _chat(gateway, api_key).status_code == 200
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        headers=auth,
        timeout=30,
        json={
            "model": SIM_MODEL,
            "messages": [{"role": "user", "content": "stream"}],
            "max_tokens": 24,  # 0.12 s of tokens: more than one chunk on a busy machine too
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as streamed:
        assert streamed.status_code == 200
        lines = list(streamed.iter_lines())
    assert "data: [DONE]" in lines
    # The worker sends tokens that come while it publishes in one chunk (its Coalescer): on a busy
    # machine the tokens come in fewer chunks, and the session manager times the gaps between those.
    streamed_chunks = sum(1 for line in lines if line.startswith("data: {") and json.loads(line[6:])["choices"])
    completion = httpx.post(
        f"{gateway.url}/v1/completions",
        headers=auth,
        timeout=30,
        json={"model": SIM_MODEL, "prompt": "Once", "max_tokens": 3},
    )
    assert completion.status_code == 200
    # A prompt of whole KV-cache blocks: the worker's engine publishes them into the prefix index.
    document = " ".join(f"observed{i}" for i in range(40))
    assert _chat(gateway, api_key, messages=[{"role": "user", "content": document}]).status_code == 200

    session = httpx.post(f"{gateway.url}/v1/sessions", headers=auth, json={"title": "observed"}, timeout=10)
    assert session.status_code == 201
    session_id = session.json()["id"]
    session_request_id = f"obs-session-{uuid.uuid4().hex[:8]}"
    for turn in range(2):  # the second turn reads the history the first stored
        rid = session_request_id if turn else None
        assert _chat(gateway, api_key, session_id=session_id, request_id=rid).status_code == 200

    assert _chat(gateway, "axk_not-a-real-key-000000000000000000000000").status_code == 401
    limited = asyncio.run(create_key(database_url, name="obs-limited", limits=KeyLimits(rpm=1)))
    statuses = [_chat(gateway, limited).status_code for _ in range(3)]
    assert statuses[0] == 200 and 429 in statuses[1:], statuses
    assert _chat(gateway, api_key, model="no-such-model").status_code == 404
    _run_batch(gateway, api_key)

    request_id = f"obs-{uuid.uuid4().hex[:8]}"
    traced = _chat(gateway, api_key, request_id=request_id)
    assert traced.status_code == 200
    return {
        "request_id": request_id,
        "job_id": traced.json()["id"].removeprefix("chatcmpl-"),
        "session_id": session_id,
        "session_request_id": session_request_id,
        "limited_key": limited,
        "streamed_chunks": streamed_chunks,
    }


def _run_batch(gateway: Service, api_key: str) -> None:
    """One small batch of the sim model, run to its end."""
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=30)
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "batched"}], "max_tokens": 2}
    line = {"custom_id": "observed", "method": "POST", "url": "/v1/chat/completions", "body": body}
    file = client.files.create(file=("observed.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status != "completed":
        assert time.monotonic() < deadline, "the batch did not complete"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def backlog(stack: Stack, gateway: Service, sessions: Service, api_key: str) -> dict:
    """Three requests of one tenant to a model whose only worker runs one sequence, 4 s an answer:
    the first runs, then two more at once: the worker takes one to start next, and the other waits
    in the tenant's queue until the first ends, about 4 s, four of the shared session manager's
    queue-depth polls (`SESSIONS_ENV`). Returns the model and the worker's scrape once the three
    were answered.

    The two are sent once the first runs and the worker has reported its sequence taken: before
    that, its report of one free sequence (every second) can come between the first's reservation
    and its start, and the second would be pushed to the worker on a reservation too (held there,
    unseen by the fair share's count), the third taken to start next, and nothing ever waits."""
    model = f"obs-tenant-{uuid.uuid4().hex[:6]}"
    env = {"AXON_SIM_MAX_SEQS": "1", "AXON_FAIR_HEADROOM_SEQS": "0", "AXON_SIM_ITL_MS": "50"}
    worker = stack.start(f"worker:{model}", env={"AXON_ENGINE": "sim", "AXON_MODEL": model, **env})
    free_key = Names(stack.namespace).fair(model, "interactive", "free")
    try:
        wait_listed(client_for(gateway, api_key), model)

        def first_runs() -> bool:
            running = _scrape(worker).value("axon_worker_tenant_sequences", model=model, tenant=TENANT)
            with redis.Redis.from_url(stack.redis_url) as client:
                free = client.hvals(free_key)
            return running == 1 and bool(free) and all(value.startswith(b"0:") for value in free)

        def waiting_seen() -> bool:
            labels = {"model": model, "tenant": TENANT, "band": "interactive"}
            return (_scrape(sessions).value("axon_sessions_tenant_waiting_jobs", **labels) or 0) > 0

        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(_chat, gateway, api_key, model=model, max_tokens=80)]
            _eventually(first_runs, timeout_s=15, message="the first request never ran alone on the worker")
            answers += [pool.submit(_chat, gateway, api_key, model=model, max_tokens=80) for _ in range(2)]
            _eventually(waiting_seen, timeout_s=15, message="no poll counted the tenant's waiting jobs")
            assert [a.result().status_code for a in answers] == [200] * 3
        return {"model": model, "worker": _scrape(worker)}
    finally:
        worker.stop(timeout_s=15)
        stack.services.remove(worker)


@pytest.fixture(scope="module")
def scrapes(traffic: dict, backlog: dict, stack: Stack, sessions: Service) -> dict[str, Scrape]:
    """One scrape per service (by scrape job), once the polled and written-behind metrics have values."""

    def ready() -> bool:
        scrape = _scrape(sessions)
        return (
            scrape.value("axon_sessions_queue_depth", model=SIM_MODEL) is not None
            and (scrape.value("axon_sessions_persisted_rows_total") or 0) > 0
        )

    _eventually(ready, timeout_s=20, message="queue depth never polled, or the outbox never persisted")
    return {JOBS[s.name]: _scrape(s) for s in stack.services if s.name in JOBS}


def test_every_metric_a_dashboard_or_alert_queries_is_exported(scrapes: dict[str, Scrape]) -> None:
    declared = set().union(*(s.declared for s in scrapes.values()))
    sampled = set().union(*(s.sampled for s in scrapes.values()))
    queried = queried_metrics()
    assert queried, "no dashboard or alert rule found"
    skipped = PENDING_WORKER_METRICS | GPU_ONLY_METRICS | SYNTHETIC_METRICS | VLLM_METRICS
    missing = {name: sorted(where) for name, where in queried.items() if name not in declared and name not in skipped}
    assert not missing, f"queried but exported by no service: {missing}"
    quiet_allowed = ONLY_ON_FAILURE | ONLY_ON_COLD_START | GPU_ONLY_METRICS
    silent = {
        name: sorted(where)
        for name, where in queried.items()
        if name in declared and name not in sampled and name not in quiet_allowed
    }
    assert not silent, f"exported but without any series after the test traffic: {silent}"
    now_exported = sorted(PENDING_WORKER_METRICS & declared)
    assert not now_exported, f"the worker exports {now_exported} now: remove them from PENDING_WORKER_METRICS"
    assert PENDING_WORKER_METRICS <= set(queried), "PENDING_WORKER_METRICS lists metrics nothing queries"


def test_selectors_name_the_job_that_exports_the_metric(scrapes: dict[str, Scrape]) -> None:
    skipped = PENDING_WORKER_METRICS | GPU_ONLY_METRICS | SYNTHETIC_METRICS | VLLM_METRICS
    for metric, job in sorted(queried_metric_jobs()):
        assert job in scrapes, f'{metric}{{job="{job}"}}: no scrape job is called {job}'
        if metric not in skipped:
            assert metric in scrapes[job].declared, f'{metric}{{job="{job}"}}: the {job} does not export it'


def test_traffic_is_counted_by_route_model_status_and_kind(traffic: dict, scrapes: dict[str, Scrape]) -> None:
    gateway, sessions, worker = scrapes["gateway"], scrapes["sessions"], scrapes["worker"]
    chat = "/v1/chat/completions"
    for status in ("200", "401", "404", "429"):
        assert gateway.value("axon_http_requests_total", route=chat, status=status), status
    assert gateway.value("axon_gateway_rate_limited_total", kind="requests") >= 1
    assert gateway.value("axon_gateway_auth_failures_total", reason="unknown") >= 1
    assert sessions.value("axon_sessions_completion_requests_total", route=chat, model=SIM_MODEL, status="200") >= 5
    assert sessions.value("axon_sessions_completion_requests_total", route="/v1/completions", model=SIM_MODEL) >= 1
    # A model nobody serves is not a label value: clients choose model names.
    assert sessions.value("axon_sessions_completion_requests_total", model="unknown", status="404") >= 1
    assert sessions.value("axon_sessions_completion_requests_total", model="no-such-model") is None
    assert sessions.value("axon_sessions_time_to_first_token_seconds_count", model=SIM_MODEL) >= 5
    assert traffic["streamed_chunks"] > 1
    gaps = sessions.value("axon_sessions_inter_chunk_latency_seconds_count", model=SIM_MODEL)
    assert gaps >= traffic["streamed_chunks"] - 1
    assert sessions.value("axon_sessions_history_cache_total") >= 1
    assert sessions.value("axon_sessions_live_workers", model=SIM_MODEL) >= 1
    assert sessions.value("axon_sessions_queue_consumers", model=SIM_MODEL) >= 1
    assert sessions.value("axon_sessions_queue_depth", model=SIM_MODEL) >= 0
    assert worker.value("axon_worker_output_tokens_total", model=SIM_MODEL) >= 20


def test_active_sessions_return_to_zero_after_their_turns(traffic: dict, sessions: Service) -> None:
    _eventually(
        lambda: _scrape(sessions).value("axon_sessions_active_sessions") == 0,
        timeout_s=15,
        message="a finished session turn is still counted as active",
    )


def test_a_tenants_waiting_jobs_and_their_wait_are_counted(backlog: dict, sessions: Service) -> None:
    """The jobs that waited in the tenant's queue (counted while they waited: `backlog`) are not
    counted once taken, and the worker measured their waits and served tokens under the tenant."""
    model, worker = backlog["model"], backlog["worker"]
    labels = {"model": model, "tenant": TENANT}
    _eventually(
        lambda: _scrape(sessions).value("axon_sessions_tenant_waiting_jobs", **labels, band="interactive") == 0,
        timeout_s=15,
        message="the tenant's jobs were all taken but it is still reported waiting",
    )
    assert worker.value("axon_worker_tenant_queue_wait_seconds_count", **labels, band="interactive") == 3
    # One answer is 80 tokens at 50 ms (4 s): the second waited about one answer, the third two
    # (less what the first had run when they were sent, well under a second).
    assert worker.value("axon_worker_tenant_queue_wait_seconds_sum", **labels, band="interactive") >= 8
    assert worker.value("axon_worker_tenant_tokens_total", **labels, band="interactive", kind="output") == 240
    assert worker.value("axon_worker_tenant_tokens_total", **labels, band="interactive", kind="prompt") > 0
    assert worker.value("axon_worker_tenant_sequences", **labels) == 0
    fairness = _scrape(sessions).value("axon_sessions_fairness_index", model=model, band="interactive")
    assert fairness == 1  # one tenant is never unfair


async def test_queue_depth_and_live_workers_follow_rabbitmq_and_heartbeats(
    stack: Stack, sessions: Service, namespace: str
) -> None:
    """A model whose only worker stopped reports 0 live workers, and the jobs left in its queue."""
    model = f"obs-queue-{uuid.uuid4().hex[:6]}"
    queue = f"{namespace}.jobs.{model}"
    worker = stack.start(f"worker:{model}", env={"AXON_ENGINE": "sim", "AXON_MODEL": model})

    async def sessions_report(name: str, value: float, message: str) -> None:
        deadline = time.monotonic() + 20
        while (await asyncio.to_thread(_scrape, sessions)).value(name, model=model) != value:
            assert time.monotonic() < deadline, message
            await asyncio.sleep(0.25)

    await sessions_report("axon_sessions_queue_consumers", 1, "the new model's queue was never polled")
    await sessions_report("axon_sessions_live_workers", 1, "the new worker's heartbeat was not counted")
    await asyncio.to_thread(worker.stop)
    await sessions_report("axon_sessions_live_workers", 0, "a model without workers must report 0 live workers")
    connection = await aio_pika.connect(stack.amqp_url)
    try:
        channel = await connection.channel()
        for i in range(3):
            await channel.default_exchange.publish(aio_pika.Message(f"job {i}".encode()), routing_key=queue)
        await sessions_report("axon_sessions_queue_depth", 3, "jobs waiting in the queue were not counted")
        await channel.queue_delete(queue)
        await sessions_report("axon_sessions_queue_depth", 0, "a deleted queue must read as empty")
    finally:
        await connection.close()


def _log_lines(service: Service) -> list[dict]:
    lines = []
    for raw in service.log_text().splitlines():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict):
            lines.append(entry)
    return lines


def _logged(service: Service, **fields: str) -> bool:
    return any(fields.items() <= e.items() for e in _log_lines(service))


def _lines_of(service: Service, **fields: str) -> list[dict]:
    deadline = time.monotonic() + 5
    while True:
        found = [e for e in _log_lines(service) if fields.items() <= e.items()]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_one_request_is_correlated_across_services_in_json_logs(
    traffic: dict, gateway: Service, sessions: Service, sim_worker: Service
) -> None:
    request_id, job_id = traffic["request_id"], traffic["job_id"]
    per_service = {s.name: _lines_of(s, request_id=request_id) for s in (gateway, sessions, sim_worker)}
    for name, lines in per_service.items():
        assert lines, f"{name} wrote no line with request_id {request_id}"
        for line in lines:
            assert {"timestamp", "level", "service", "event"} <= line.keys(), line
    access = [e for e in per_service["gateway"] if e["event"] == "http_request"]
    assert access and access[0]["tenant"] == "tests" and access[0]["status"] == 200
    assert any(e.get("job_id") == job_id and e.get("tenant") == "tests" for e in per_service["sessions"])
    assert any(e.get("job_id") == job_id and e.get("tenant") == "tests" for e in per_service["worker:sim"])


def test_session_turns_log_their_session_id(traffic: dict, sessions: Service) -> None:
    lines = _lines_of(sessions, request_id=traffic["session_request_id"])
    assert lines and all(e.get("session_id") == traffic["session_id"] for e in lines), lines


def test_logs_never_contain_an_api_key_or_prompt_or_answer_text(
    traffic: dict, stack: Stack, gateway: Service, sessions: Service, api_key: str
) -> None:
    created = httpx.post(
        f"{gateway.url}/admin/keys",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        json={"name": "obs-log-check"},
        timeout=10,
    )
    assert created.status_code == 201
    admin_key = created.json()["key"]
    secret_prompt = f"prompt-marker-{uuid.uuid4().hex}"
    ids = {what: f"obs-secrets-{what}-{uuid.uuid4().hex[:8]}" for what in ("answered", "refused", "invalid")}
    answered = _chat(
        gateway,
        admin_key,
        request_id=ids["answered"],
        messages=[{"role": "user", "content": secret_prompt}],
        max_tokens=12,
    )
    assert answered.status_code == 200
    answer = answered.json()["choices"][0]["message"]["content"]
    assert len(answer.split()) == 12
    bad_key = f"axk_{uuid.uuid4().hex}{uuid.uuid4().hex}"
    assert _chat(gateway, bad_key, request_id=ids["refused"]).status_code == 401
    # an error path logs too
    assert _chat(gateway, admin_key, request_id=ids["invalid"], max_tokens=10**9).status_code == 400
    # The scan is only worth something once the lines of these requests are in the files: each
    # service logs its access line last, the worker its job's end.
    wait_for(
        lambda: (
            all(_logged(gateway, request_id=rid, event="http_request") for rid in ids.values())
            and _logged(sessions, request_id=ids["answered"], event="http_request")
            and any(_logged(s, request_id=ids["answered"], event="job_finished") for s in stack.services)
        ),
        timeout_s=10,
        what="the log lines of the requests scanned for secrets",
    )
    secrets = {
        "test API key": api_key,
        "rate-limited key": traffic["limited_key"],
        "admin-created key": admin_key,
        "unknown key": bad_key,
        "admin token": ADMIN_TOKEN,
        "prompt text": secret_prompt,
        "answer text": answer,
    }
    for service in stack.services:
        text = service.log_text()
        assert text, f"{service.name} wrote no log"
        leaked = [what for what, secret in secrets.items() if secret in text]
        assert not leaked, f"{service.name}'s log contains: {leaked}"


@pytest.mark.parametrize("name", ["gateway", "sessions", "worker:sim"])
def test_health_and_ready_answer_on_every_service(stack: Stack, name: str) -> None:
    service = next(s for s in stack.services if s.name == name)
    assert httpx.get(f"{service.url}/health", timeout=5).json() == {"status": "ok"}
    ready = httpx.get(f"{service.url}/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
