"""A worker cut off from Redis waits quietly and resumes at once (issue 29, item 3); a job nobody
can read any more stops within a step, while one that runs on without its client goes on (item 7).

One stack for the module: a sim worker whose Redis goes through a proxy the test cuts (the rest of
the stack keeps Redis), a sim worker with one sequence, and a surviving session manager and gateway;
the item 7 tests start session managers of their own to SIGKILL. Each test prints its figures as a
`RESILIENCE {...}` line (`pytest -s`), which docs/resilience.md records.
"""

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from services.cli.launcher import Service
from tests.e2e.load import Load, report, steady, stream_request
from tests.e2e.stack import Stack
from tests.e2e.tcpproxy import TcpProxy
from tests.e2e.test_chat_resume import events_of
from tests.e2e.test_workers import client_for, metric, wait_listed
from tests.services import ServiceUrls

pytestmark = pytest.mark.e2e

CUT_MODEL = "redis-cut-sim"
ONE_SEQ_MODEL = "one-seq-sim"
SIM = {"AXON_ENGINE": "sim", "AXON_SIM_TTFT_MS": "20", "AXON_SIM_ITL_MS": "10"}
MESSAGES = [{"role": "user", "content": "Tell me something."}]
CUT_S = 10.0
# The worker's log during the cut and the second after it (the outage once, then its recovery).
MAX_LOG_LINES = 50


@dataclass
class Outages:
    stack: Stack
    proxy: TcpProxy
    cut_worker: Service
    one_seq_worker: Service
    gateway: Service


@pytest.fixture(scope="module")
def outages(
    tmp_path_factory: pytest.TempPathFactory, namespace: str, database_url: str, service_urls: ServiceUrls
) -> Iterator[Outages]:
    proxy = TcpProxy.to(service_urls.redis)
    stack = Stack(
        namespace=f"{namespace}_outages_{uuid.uuid4().hex[:6]}",
        database_url=database_url,
        redis_url=service_urls.redis,
        amqp_url=service_urls.amqp,
        log_dir=tmp_path_factory.mktemp("outages"),
    )
    try:
        cut_worker = stack.start(
            "worker:redis-cut",
            env={**SIM, "AXON_MODEL": CUT_MODEL, "AXON_REDIS_URL": proxy.proxied(service_urls.redis)},
        )
        one_seq_worker = stack.start(
            "worker:one-seq", env={**SIM, "AXON_MODEL": ONE_SEQ_MODEL, "AXON_SIM_MAX_SEQS": "1"}
        )
        sessions = stack.start("sessions", env={"AXON_RESPONSE_LEASE_S": "2"})
        gateway = stack.start("gateway", env={"AXON_SESSIONS_URL": sessions.url})
        yield Outages(stack, proxy, cut_worker, one_seq_worker, gateway)
    finally:
        stack.close()
        proxy.close()


def _lines(service: Service) -> list[str]:
    return service.log_text().splitlines()


async def _completed_after(load: Load, moment_s: float, timeout_s: float) -> float:
    """How long after `moment_s` the first request completed (one in flight then counts too)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ended = [o.ended_s for o in load.outcomes if o.kind == "completed" and o.ended_s >= moment_s]
        if ended:
            return min(ended) - moment_s
        assert time.monotonic() < deadline, f"no request completed within {timeout_s} s"
        await asyncio.sleep(0.05)


async def test_a_10_s_redis_cut_the_worker_pauses_quietly_and_resumes_at_once(outages: Outages, api_key: str) -> None:
    worker, proxy = outages.cut_worker, outages.proxy
    headers = {"Authorization": f"Bearer {api_key}"}
    load = Load()
    async with httpx.AsyncClient(base_url=outages.gateway.url, timeout=httpx.Timeout(60, connect=5)) as client:
        body = {"model": CUT_MODEL, "messages": MESSAGES, "max_tokens": 20}

        async def send(stream: int, n: int):
            return await stream_request(client, "/v1/chat/completions", body, headers, deadline_s=60)

        stop = asyncio.Event()
        running = asyncio.create_task(steady(load, send, streams=4, stop=stop))
        await asyncio.sleep(3)
        assert load.counts()["completed"] > 0, load.problems()
        lines_before = len(_lines(worker))
        await asyncio.to_thread(proxy.cut)
        await asyncio.sleep(2)
        ready = await client.get(f"{worker.url}/ready")
        await asyncio.sleep(CUT_S - 2)
        await asyncio.to_thread(proxy.restore)
        up_at = time.monotonic()
        recovery_s = await _completed_after(load, up_at, timeout_s=30)
        fresh = None
        while fresh is None:
            assert time.monotonic() - up_at < 30, "no request sent after the cut completed"
            await asyncio.sleep(0.05)
            fresh = load.first_completed_after(up_at)
        await asyncio.sleep(1)
        during = _lines(worker)[lines_before:]
        stop.set()
        await running
    counts = load.counts()
    events: dict[str, int] = {}
    for line in during:
        event = json.loads(line).get("event", "?") if line.startswith("{") else "(not json)"
        events[event] = events.get(event, 0) + 1
    dead_lettered = metric(worker, "axon_worker_jobs_total", model=CUT_MODEL, outcome="dead_lettered")
    failed = metric(worker, "axon_worker_jobs_total", model=CUT_MODEL, outcome="failed")
    report(
        "redis cut between a worker and Redis",
        **counts,
        cut_s=CUT_S,
        worker_log_lines=len(during),
        worker_log_bytes=sum(len(line) + 1 for line in during),
        worker_events=events,
        ready_during_cut=[ready.status_code, ready.json().get("reason")],
        first_completed_after_s=round(recovery_s, 2),
        first_new_request_completed_after_s=round(fresh.ended_s - up_at, 2),
        dead_lettered=dead_lettered,
        failed=failed,
    )
    assert ready.status_code == 503 and "Redis" in ready.json()["reason"]
    assert len(during) < MAX_LOG_LINES, during[:20]
    assert counts["lost"] == counts["hung"] == 0, load.problems()
    assert recovery_s <= 2
    assert fresh.ended_s - up_at <= 3
    assert dead_lettered == failed == 0
    assert not any("Traceback" in line or "job_crashed" in line for line in during)


def _stream_first_events(gateway: Service, api_key: str, body: dict, count: int) -> tuple[httpx.Client, list]:
    """Open a stream through `gateway` and read its first `count` events, leaving it open."""
    http = httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
    response = http.send(http.build_request("POST", "/v1/chat/completions", json=body), stream=True)
    assert response.status_code == 200
    return http, events_of(response, stop_after=count)


def _first_token_s(gateway: Service, api_key: str, model: str) -> float:
    """How long a new stream waits for its first token."""
    http = httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
    started = time.monotonic()
    body = {"model": model, "messages": MESSAGES, "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        first = events_of(response, stop_after=1)
        waited = time.monotonic() - started
    http.close()
    assert first and not first[0].done
    return waited


def test_a_killed_session_managers_plain_stream_frees_its_workers_sequence(outages: Outages, api_key: str) -> None:
    stack, worker = outages.stack, outages.one_seq_worker
    victim = stack.start("sessions:plain-victim")
    victim_gateway = stack.start("gateway:plain-victim", env={"AXON_SESSIONS_URL": victim.url})
    wait_listed(client_for(outages.gateway, api_key), ONE_SEQ_MODEL)
    unheard_before = metric(worker, "axon_worker_jobs_total", model=ONE_SEQ_MODEL, outcome="unheard")
    # 3,000 tokens 10 ms apart: 30 s of work on the worker's only sequence.
    body = {"model": ONE_SEQ_MODEL, "messages": MESSAGES, "max_tokens": 3000, "stream": True}
    http, _first = _stream_first_events(victim_gateway, api_key, body, count=5)
    victim.kill()
    killed_at = time.monotonic()
    waited_s = _first_token_s(outages.gateway, api_key, ONE_SEQ_MODEL)
    http.close()
    after_kill_s = time.monotonic() - killed_at
    unheard = metric(worker, "axon_worker_jobs_total", model=ONE_SEQ_MODEL, outcome="unheard") - unheard_before
    report(
        "session manager SIGKILLed mid-stream, worker with one sequence",
        next_request_first_token_s=round(waited_s, 2),
        first_token_after_kill_s=round(after_kill_s, 2),
        unheard=unheard,
    )
    assert waited_s < 2
    assert unheard == 1


def test_a_killed_session_managers_resumable_turn_and_stored_response_run_on(outages: Outages, api_key: str) -> None:
    stack, worker = outages.stack, outages.one_seq_worker
    victim = stack.start("sessions:run-on-victim", env={"AXON_RESPONSE_LEASE_S": "1"})
    victim_gateway = stack.start("gateway:run-on-victim", env={"AXON_SESSIONS_URL": victim.url})
    victim_client, survivor = client_for(victim_gateway, api_key), client_for(outages.gateway, api_key)
    wait_listed(victim_client, ONE_SEQ_MODEL)
    unheard_before = metric(worker, "axon_worker_jobs_total", model=ONE_SEQ_MODEL, outcome="unheard")
    auth = {"Authorization": f"Bearer {api_key}"}
    session_id = httpx.post(f"{victim_gateway.url}/v1/sessions", json={}, headers=auth, timeout=10).json()["id"]
    turn = {"model": ONE_SEQ_MODEL, "messages": MESSAGES, "max_tokens": 150, "stream": True, "session_id": session_id}
    http, first = _stream_first_events(victim_gateway, api_key, turn, count=5)
    completion_id = json.loads(first[0].data)["id"]
    # Queued behind the turn on the worker's only sequence: it starts after its relay is dead.
    stored = victim_client.responses.create(
        model=ONE_SEQ_MODEL, input="A stored story.", max_output_tokens=100, background=True
    )
    victim.kill()
    http.close()

    resumed = httpx.get(
        f"{outages.gateway.url}/v1/chat/completions/{completion_id}/stream",
        headers={**auth, "Last-Event-ID": first[-1].id or ""},
        timeout=60,
    )
    rest = events_of(resumed)
    assert rest and rest[-1].done
    text = "".join(e.delta for e in first + rest[:-1])
    assert len(text.split()) == 150  # the simulator's answer: one word per token
    deadline = time.monotonic() + 30
    while (done := survivor.responses.retrieve(stored.id)).status not in {"completed", "incomplete", "failed"}:
        assert time.monotonic() < deadline, done.status
        time.sleep(0.1)
    report(
        "session manager SIGKILLed with a resumable turn mid-stream and a stored response queued",
        turn_words=len(text.split()),
        stored_status=done.status,
        stored_output_tokens=done.usage.output_tokens if done.usage else None,
    )
    assert done.status == "incomplete" and done.usage is not None and done.usage.output_tokens == 100
    assert metric(worker, "axon_worker_jobs_total", model=ONE_SEQ_MODEL, outcome="unheard") == unheard_before
    # The stored response's job waited in its tenant's queue (the fair share) when its session
    # manager died, and ran once all the same.
    waited = metric(
        worker, "axon_worker_tenant_queue_wait_seconds_count", band="interactive", model=ONE_SEQ_MODEL, tenant="tests"
    )
    assert waited >= 2
