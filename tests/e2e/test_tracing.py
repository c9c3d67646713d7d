"""Traces through the running stack (issue 30): one trace per request whose spans come from the
gateway, the session manager and the worker, linked across the broker and back, received by an
OTLP/HTTP receiver this module runs; a failed-over job joins its request's trace; the request's
log lines carry its trace id; the latency histograms carry exemplars in the OpenMetrics format; a
malformed `traceparent` starts a new trace; a collector that is down costs no request anything.
"""

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli.launcher import Service
from tests.e2e.otlp import OtlpReceiver, ReceivedSpan
from tests.e2e.stack import INTERNAL_AUTH, Stack
from tests.e2e.test_workers import holder, metric
from tests.services import ServiceUrls

pytestmark = pytest.mark.e2e

MODEL = "trace-sim"
# The OTLP exporters' batch delay, short so the test waits less for spans (OpenTelemetry's own setting).
_EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "200", "AXON_TRACE_EXPORT_TIMEOUT_S": "1"}
_SERVER, _CLIENT, _PRODUCER, _CONSUMER = 2, 3, 4, 5  # opentelemetry.proto's SpanKind values
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture(scope="module")
def traced(
    receiver: OtlpReceiver, namespace: str, database_url: str, service_urls: ServiceUrls, log_dir: Path
) -> Iterator[Stack]:
    """Two sim workers, a session manager and a gateway, every one exporting its spans to `receiver`."""
    stack = Stack(
        namespace=f"{namespace}_trace",
        database_url=database_url,
        redis_url=service_urls.redis,
        amqp_url=service_urls.amqp,
        log_dir=log_dir,
    )
    env = {"AXON_OTLP_ENDPOINT": receiver.endpoint, **_EXPORT_ENV}
    worker_env = {**env, "AXON_ENGINE": "sim", "AXON_MODEL": MODEL, "AXON_SIM_TTFT_MS": "20", "AXON_SIM_ITL_MS": "20"}
    try:
        for name in ("worker:trace-a", "worker:trace-b"):
            stack.start(name, env=worker_env)
        # A short response lease: it takes over a dead session manager's stored responses sooner.
        sessions = stack.start("sessions", env={**env, "AXON_RESPONSE_LEASE_S": "2"})
        stack.start("gateway", env={**env, "AXON_SESSIONS_URL": sessions.url})
        yield stack
    finally:
        stack.close()


def _service(stack: Stack, name: str) -> Service:
    return next(s for s in stack.services if s.name == name)


def _workers(stack: Stack) -> list[Service]:
    return [s for s in stack.services if s.name.startswith("worker:")]


def _chat(stack: Stack, api_key: str, *, headers: dict[str, str] | None = None, **body) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4, **body}
    return httpx.post(
        f"{_service(stack, 'gateway').url}/v1/chat/completions",
        json=payload,
        headers={"Authorization": f"Bearer {api_key}", **(headers or {})},
        timeout=60,
    )


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, sorted((s.service, s.name) for s in spans))
    return found[0]


_REQUEST_SPANS = {
    ("axon-gateway", "POST /v1/chat/completions"),
    ("axon-sessions", "POST /v1/chat/completions"),
    ("axon-sessions", "relay"),
    ("axon-worker", "job"),
    ("axon-worker", "generation"),
}


def _complete(spans: list[ReceivedSpan]) -> bool:
    """A chat completion's spans from every process have arrived (each exports on its own)."""
    return _REQUEST_SPANS <= {(s.service, s.name) for s in spans}


def test_a_session_turn_is_one_trace_across_gateway_sessions_worker_and_back(
    traced: Stack, receiver: OtlpReceiver, api_key: str
) -> None:
    auth = {"Authorization": f"Bearer {api_key}"}
    gateway = _service(traced, "gateway")
    session = httpx.post(f"{gateway.url}/v1/sessions", headers=auth, json={}, timeout=10).json()["id"]
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        headers=auth,
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        | {"session_id": session},
    ) as streamed:
        assert streamed.status_code == 200
        lines = list(streamed.iter_lines())
        assert "data: [DONE]" in lines
        trace_id = streamed.headers["x-axon-trace-id"]
    assert _HEX32.match(trace_id)
    spans = receiver.wait_for(trace_id, lambda s: _complete(s) and any(x.name == "history write" for x in s))

    request = _one(spans, "axon-gateway", "POST /v1/chat/completions")
    assert request.parent_span_id == "" and request.kind == _SERVER
    assert request.attributes["http.response.status_code"] == 200
    for name in ("authenticate", "admission", "upstream"):
        assert _one(spans, "axon-gateway", name).parent_span_id == request.span_id
    upstream = _one(spans, "axon-gateway", "upstream")
    assert upstream.kind == _CLIENT

    # The session manager's request span is the child of the gateway's upstream call.
    handled = _one(spans, "axon-sessions", "POST /v1/chat/completions")
    assert handled.parent_span_id == upstream.span_id and handled.kind == _SERVER
    for name in ("history", "build job", "publish", "first chunk", "relay"):
        assert _one(spans, "axon-sessions", name).parent_span_id == handled.span_id, name
    publish = _one(spans, "axon-sessions", "publish")
    assert publish.kind == _PRODUCER

    # Across the broker: the worker's job is the child of the publish, its queue time beside it.
    job = _one(spans, "axon-worker", "job")
    assert job.parent_span_id == publish.span_id and job.kind == _CONSUMER
    assert job.attributes["axon.outcome"] == "completed"
    assert _one(spans, "axon-worker", "queued").parent_span_id == publish.span_id
    for name in ("prefill", "generation", "publish"):
        assert _one(spans, "axon-worker", name).parent_span_id == job.span_id, name
    assert _one(spans, "axon-worker", "generation").attributes["axon.completion_tokens"] == 4

    # And back: the final chunk carried the job span's context, which the relay links to.
    linked = [s for s in spans if s.service == "axon-sessions" and (trace_id, job.span_id) in s.links]
    assert [s.name for s in linked] in (["relay"], ["first chunk"])
    # The answer is stored after the relay's last chunk (session history write).
    assert _one(spans, "axon-sessions", "history write").trace_id == trace_id
    assert len({s.trace_id for s in spans}) == 1

    # A resumed stream is a request of its own, whose span links to the one that started the stream.
    completion_id = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])["id"]
    resumed = httpx.get(f"{gateway.url}/v1/chat/completions/{completion_id}/stream", headers=auth, timeout=30)
    assert resumed.status_code == 200 and resumed.text.rstrip().endswith("data: [DONE]")
    resume_trace = resumed.headers["x-axon-trace-id"]
    assert resume_trace != trace_id
    route = "GET /v1/chat/completions/{completion_id}/stream"
    both = {"axon-gateway", "axon-sessions"}
    resume_spans = receiver.wait_for(resume_trace, lambda s: {x.service for x in s} >= both)
    resume = _one(resume_spans, "axon-sessions", route)
    assert resume.parent_span_id == _one(resume_spans, "axon-gateway", route).span_id
    assert resume.links == ((trace_id, handled.span_id),)


def test_a_clients_traceparent_is_honoured_and_a_malformed_one_starts_a_new_trace(
    traced: Stack, receiver: OtlpReceiver, api_key: str
) -> None:
    client_trace, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    honoured = _chat(traced, api_key, headers={"traceparent": f"00-{client_trace}-{client_span}-01"})
    assert honoured.status_code == 200
    assert honoured.headers["x-axon-trace-id"] == client_trace
    spans = receiver.wait_for(client_trace, _complete)
    assert _one(spans, "axon-gateway", "POST /v1/chat/completions").parent_span_id == client_span

    for malformed in (f"00-{client_trace}-zzzz-01", "garbage", f"ff-{'0' * 32}-{client_span}-01"):
        answered = _chat(traced, api_key, headers={"traceparent": malformed})
        assert answered.status_code == 200, answered.text
        trace_id = answered.headers["x-axon-trace-id"]
        assert _HEX32.match(trace_id) and trace_id != client_trace
        root = _one(receiver.wait_for(trace_id, _complete), "axon-gateway", "POST /v1/chat/completions")
        assert root.parent_span_id == ""


def test_every_log_line_of_a_request_carries_its_trace_id(traced: Stack, receiver: OtlpReceiver, api_key: str) -> None:
    request_id = f"traced-{uuid.uuid4().hex[:8]}"
    answered = _chat(traced, api_key, headers={"x-request-id": request_id})
    assert answered.status_code == 200
    trace_id = answered.headers["x-axon-trace-id"]
    span_ids = {s.span_id for s in receiver.wait_for(trace_id, _complete)}
    lines: dict[str, list[dict]] = {}
    deadline = time.monotonic() + 10
    while {"gateway", "sessions", "worker"} - lines.keys():  # the worker's line comes after the answer
        assert time.monotonic() < deadline, lines.keys()
        lines = {}
        for service in traced.services:
            for text in service.log_text().splitlines():
                if request_id in text:
                    line = json.loads(text)
                    lines.setdefault(line["service"], []).append(line)
        time.sleep(0.2)
    for service, found in lines.items():
        for line in found:
            assert line["request_id"] == request_id
            assert line["trace_id"] == trace_id, (service, line)
            assert line["span_id"] in span_ids, (service, line)


def test_latency_histograms_carry_trace_exemplars_in_openmetrics(traced: Stack, api_key: str) -> None:
    answered = _chat(traced, api_key)
    assert answered.status_code == 200
    trace_id = answered.headers["x-axon-trace-id"]
    openmetrics = {"accept": "application/openmetrics-text; version=1.0.0", **INTERNAL_AUTH}
    histograms = {
        "sessions": ["axon_sessions_time_to_first_token_seconds", "axon_http_request_duration_seconds"],
        "gateway": ["axon_http_request_duration_seconds"],
    }
    for name, families in histograms.items():
        scraped = httpx.get(f"{_service(traced, name).url}/metrics", headers=openmetrics, timeout=10)
        assert scraped.headers["content-type"].startswith("application/openmetrics-text")
        assert scraped.text.rstrip().endswith("# EOF")
        for family in families:
            exemplars = re.findall(
                rf'^{family}_bucket{{.*}} \S+ # {{.*trace_id="([0-9a-f]{{32}})".*}}', scraped.text, re.M
            )
            assert trace_id in exemplars, (name, family, exemplars)
    worker_text = "\n".join(
        httpx.get(f"{w.url}/metrics", headers=openmetrics, timeout=10).text for w in _workers(traced)
    )
    assert re.search(
        rf'^axon_worker_time_to_first_token_seconds_bucket{{.*}} \S+ # {{.*trace_id="{trace_id}"', worker_text, re.M
    )
    # A scraper that does not ask for OpenMetrics gets Prometheus' text format, without exemplars.
    plain = httpx.get(f"{_service(traced, 'gateway').url}/metrics", headers=INTERNAL_AUTH, timeout=10)
    assert plain.headers["content-type"].startswith("text/plain") and "trace_id" not in plain.text


def test_a_failed_over_job_joins_its_requests_trace(traced: Stack, receiver: OtlpReceiver, api_key: str) -> None:
    workers = _workers(traced)
    gateway = _service(traced, "gateway")
    auth = {"Authorization": f"Bearer {api_key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "fail over"}], "max_tokens": 80, "stream": True}
    killed = None
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", headers=auth, json=body, timeout=60) as streamed:
        trace_id = streamed.headers["x-axon-trace-id"]
        lines = []
        for line in streamed.iter_lines():
            lines.append(line)
            if len(lines) == 40 and killed is None:  # 13 events, each an id, a data and a blank line
                killed = holder(workers, MODEL)
                killed.kill()
        assert "data: [DONE]" in lines
    assert killed is not None
    survivor = next(w for w in workers if w is not killed)
    assert metric(survivor, "axon_worker_jobs_total", model=MODEL, outcome="resumed") == 1
    spans = receiver.wait_for(trace_id, _complete)
    publish = _one(spans, "axon-sessions", "publish")
    job = _one(spans, "axon-worker", "job")  # the killed worker's never ended, so never left it
    assert job.parent_span_id == publish.span_id
    assert job.attributes["messaging.message.redelivered"] is True
    assert job.attributes["resource.service.instance.id"] == job.attributes["axon.worker_id"]
    assert any((trace_id, job.span_id) in s.links for s in spans if s.service == "axon-sessions")


def _response_status(gateway: Service, auth: dict[str, str], response_id: str, wanted: set[str]) -> str:
    deadline = time.monotonic() + 30
    while True:
        status = httpx.get(f"{gateway.url}/v1/responses/{response_id}", headers=auth, timeout=10).json()["status"]
        if status in wanted:
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def test_a_stored_response_taken_over_joins_its_requests_trace(
    traced: Stack, receiver: OtlpReceiver, api_key: str
) -> None:
    env = {"AXON_OTLP_ENDPOINT": receiver.endpoint, **_EXPORT_ENV}
    victim = traced.start("sessions:victim", env={**env, "AXON_RESPONSE_LEASE_S": "2"})
    victim_gateway = traced.start("gateway:victim", env={**env, "AXON_SESSIONS_URL": victim.url})
    auth = {"Authorization": f"Bearer {api_key}"}
    body = {"model": MODEL, "input": "a long story", "background": True, "max_output_tokens": 150}
    created = httpx.post(f"{victim_gateway.url}/v1/responses", headers=auth, json=body, timeout=30)
    assert created.status_code == 200, created.text
    trace_id, response_id = created.headers["x-axon-trace-id"], created.json()["id"]
    survivor = _service(traced, "gateway")
    _response_status(survivor, auth, response_id, {"in_progress"})
    # The victim's request span is exported before it dies (a killed process loses what it holds).
    receiver.wait_for(trace_id, lambda s: ("axon-sessions", "POST /v1/responses") in {(x.service, x.name) for x in s})
    victim.kill()
    # The simulator answers exactly max_output_tokens: `incomplete`, as OpenAI ends such an answer.
    assert _response_status(survivor, auth, response_id, {"completed", "incomplete", "failed"}) == "incomplete"
    spans = receiver.wait_for(trace_id, lambda s: any(x.name == "take over" for x in s))
    take_over = _one(spans, "axon-sessions", "take over")
    assert take_over.parent_span_id == _one(spans, "axon-sessions", "POST /v1/responses").span_id
    assert take_over.attributes["axon.response_id"] == response_id


def test_a_collector_that_is_down_costs_requests_nothing(traced: Stack, receiver: OtlpReceiver, api_key: str) -> None:
    receiver.close()
    gateway = _service(traced, "gateway")
    started = time.monotonic()
    for _ in range(5):
        answered = _chat(traced, api_key)
        assert answered.status_code == 200
        assert _HEX32.match(answered.headers["x-axon-trace-id"])
    # Five requests of 4 tokens at 20 ms each: far below one export's timeout per request.
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 30
    while metric(gateway, "axon_trace_spans_dropped_total", reason="export_failed") == 0:
        assert time.monotonic() < deadline, "no dropped span counted"
        time.sleep(0.5)
