"""Slow and abusive clients against a gateway with short connection limits: idle and half-sent
requests time out, huge heads are refused at once, and a client that stops reading is cut off
without stalling anyone else (and its generation is cancelled); hostile JSON schemas are refused,
or answered within max_tokens, while the worker's /health answers (issue 29)."""

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from services.cli.launcher import Service
from tests.e2e.hostile_schemas import ADMITTED, NOWHERE, REFUSED, TOO_COMPLEX, Hostile, Sender, check, health_watched
from tests.e2e.load import report
from tests.e2e.stack import Stack
from tests.e2e.test_workers import metric

pytestmark = pytest.mark.e2e

MODEL = "hostile-sim"
LIMITS = {
    "AXON_REQUEST_HEAD_TIMEOUT_S": "1",
    "AXON_REQUEST_BODY_TIMEOUT_S": "1",
    "AXON_MAX_HEADER_BYTES": "8192",
    "AXON_CLIENT_STALL_TIMEOUT_S": "2",
    "AXON_CLIENT_SEND_BUFFER_BYTES": "16384",
}


@pytest.fixture(scope="module")
def hostile(stack: Stack) -> Iterator[tuple[Service, Service]]:
    """A fast sim worker, its session manager (long answers allowed) and a gateway with short limits."""
    worker = stack.start(
        "worker:hostile",
        env={
            "AXON_ENGINE": "sim",
            "AXON_MODEL": MODEL,
            "AXON_SIM_TTFT_MS": "0",
            "AXON_SIM_ITL_MS": "0.5",
            "AXON_SIM_CONTEXT_TOKENS": "100000",
        },
    )
    sessions = stack.start("sessions:hostile", env={"AXON_MAX_TOKENS_LIMIT": "50000"})
    gateway = stack.start("gateway:hostile", env={"AXON_SESSIONS_URL": sessions.url, **LIMITS})
    yield gateway, worker


def _connect(service: Service) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", service.port), timeout=10)
    return sock


def _read_all(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and how long that took."""
    sock.settimeout(timeout_s)
    started, received = time.monotonic(), b""
    while chunk := sock.recv(65536):
        received += chunk
    return received, time.monotonic() - started


def test_an_idle_connection_is_closed_after_the_head_timeout(hostile) -> None:
    gateway, _ = hostile
    with _connect(gateway) as sock:
        received, waited_s = _read_all(sock, timeout_s=10)
    assert received == b"" and 0.8 < waited_s < 5
    report("idle connection (head timeout 1 s)", outcome="closed, nothing sent", closed_after_s=round(waited_s, 1))


def test_a_half_sent_head_gets_408_and_the_connection_is_closed(hostile) -> None:
    gateway, _ = hostile
    with _connect(gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bear")
        received, waited_s = _read_all(sock, timeout_s=10)
    assert received.startswith(b"HTTP/1.1 408 ") and 0.8 < waited_s < 5
    error = orjson.loads(received.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout" and set(error) == {"message", "type", "param", "code"}
    report(
        "half-sent request head (head timeout 1 s)", outcome="408 request_timeout", closed_after_s=round(waited_s, 1)
    )


def test_a_huge_head_is_refused_at_once_with_431(hostile) -> None:
    gateway, _ = hostile
    with _connect(gateway) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 64 * 1024 + b"\r\n\r\n")
        received, waited_s = _read_all(sock, timeout_s=10)
    assert received.startswith(b"HTTP/1.1 431 ") and waited_s < 1
    assert orjson.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_header_too_large"
    report(
        "64 KiB request head (limit 8 KiB)", outcome="431 request_header_too_large", closed_after_s=round(waited_s, 2)
    )


def test_a_half_sent_body_gets_408_in_openai_shape(hostile, auth: dict) -> None:
    gateway, _ = hostile
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {auth['Authorization']}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with _connect(gateway) as sock:
        sock.sendall(head.encode() + b'{"model": "')
        received, waited_s = _read_all(sock, timeout_s=10)
    # Closed with the answer: the rest of the body must not be read as a next request.
    assert received.startswith(b"HTTP/1.1 408 ") and 0.8 < waited_s < 1.9
    assert b"\r\nconnection: close\r\n" in received.split(b"\r\n\r\n", 1)[0].lower() + b"\r\n"
    assert orjson.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    report("half-sent body (body timeout 1 s)", outcome="408 request_timeout", closed_after_s=round(waited_s, 1))


async def test_a_client_that_stops_reading_is_cut_off_without_stalling_others(hostile, auth: dict) -> None:
    gateway, worker = hostile
    cancelled_before = metric(worker, "axon_worker_jobs_total", model=MODEL, outcome="cancelled")
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 40000, "stream": True}
    )
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {auth['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing: tiny buffer
    sock.connect(("127.0.0.1", gateway.port))
    rss_before = _rss_kib(gateway)
    sock.sendall(request)
    sent = time.monotonic()
    try:
        # Meanwhile other clients are served as usual.
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(5):
                other = await client.post(
                    f"{gateway.url}/v1/chat/completions",
                    headers=auth,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                )
                assert other.status_code == 200
        # Within the stall timeout (2 s) of its buffers filling, the gateway hangs up on it
        # (40,000 tokens at 0.5 ms take 20 s: the answer cannot have simply ended).
        deadline = time.monotonic() + 15
        while not _reset_by_peer(sock):
            assert time.monotonic() < deadline, "the gateway kept the stalled client's connection"
            await asyncio.sleep(0.25)
        cut_off_s = time.monotonic() - sent
        rss_growth_kib = _rss_kib(gateway) - rss_before
    finally:
        sock.close()
    # ... and its generation was cancelled, not run to 40,000 tokens.
    deadline = time.monotonic() + 10
    while metric(worker, "axon_worker_jobs_total", model=MODEL, outcome="cancelled") <= cancelled_before:
        assert time.monotonic() < deadline, "the stalled client's job was not cancelled"
        await asyncio.sleep(0.2)
    assert "client_stalled" in gateway.log_text()
    report(
        "client stops reading a 40,000-token stream",
        others_sent=5,
        others_completed=5,
        lost=0,
        cut_off_after_s=round(cut_off_s, 1),
        gateway_rss_growth_kib=rss_growth_kib,
    )


def _rss_kib(service: Service) -> int:
    status = Path(f"/proc/{service.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def _reset_by_peer(sock: socket.socket) -> bool:
    """True once the server aborted the connection, found without reading anything."""
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        return True
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    return False


@pytest.fixture(scope="module")
def narrow_gateway(stack: Stack, hostile) -> Service:
    """A second gateway in front of the hostile session manager, forwarding at most 4 requests at once."""
    sessions = next(service for service in stack.services if service.name == "sessions:hostile")
    return stack.start("gateway:narrow", env={"AXON_SESSIONS_URL": sessions.url, "AXON_MAX_REQUESTS_IN_FLIGHT": "4"})


async def test_a_flood_past_the_in_flight_limit_is_refused_at_once_and_the_admitted_streams_finish(
    narrow_gateway: Service, auth: dict
) -> None:
    url = f"{narrow_gateway.url}/v1/chat/completions"
    # 4,000 tokens at 0.5 ms each: every admitted stream stays in flight about 2 s.
    long = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        started = [asyncio.Event() for _ in range(4)]

        async def hold(started: asyncio.Event) -> list[str]:
            async with client.stream("POST", url, headers=auth, json=long) as response:
                assert response.status_code == 200
                started.set()
                return [line async for line in response.aiter_lines() if line.startswith("data: ")]

        holders = [asyncio.create_task(hold(event)) for event in started]
        async with asyncio.timeout(10):
            await asyncio.gather(*(event.wait() for event in started))

        async def refused() -> tuple[httpx.Response, float]:
            sent = time.monotonic()
            response = await client.post(url, headers=auth, json={**long, "max_tokens": 4, "stream": False})
            return response, time.monotonic() - sent

        flood = await asyncio.gather(*(refused() for _ in range(20)))
        assert not any(holder.done() for holder in holders), "the flood must arrive while all 4 slots are taken"
        for response, _ in flood:
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "overloaded"
        slowest_refusal_ms = max(waited for _, waited in flood) * 1000
        assert slowest_refusal_ms < 1000

        streams = await asyncio.gather(*holders)
        for events in streams:
            assert events[-1] == "data: [DONE]"
            assert orjson.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        after = await client.post(url, headers=auth, json={**long, "max_tokens": 4, "stream": False})
        assert after.status_code == 200
    assert metric(narrow_gateway, "axon_gateway_overloaded_total") == 20
    report(
        "flood of 20 past a gateway's 4 requests in flight",
        sent=24,
        completed=4,
        refused_503_overloaded=20,
        lost=0,
        slowest_refusal_ms=round(slowest_refusal_ms, 1),
        next_request="200",
    )


def test_hostile_schemas_are_refused_or_answered_within_max_tokens_while_health_answers(hostile, auth: dict) -> None:
    """Issue 29 on the simulator: a schema no answer within max_tokens satisfies is a 400 from the
    session manager; the others are answered within max_tokens, the simulator building only what
    the answer carries (before: 100 % CPU, /health silent, the model gone from /v1/models)."""
    gateway, worker = hostile
    invalid_before = metric(worker, "axon_worker_jobs_total", model=MODEL, outcome="invalid")
    dead_before = metric(worker, "axon_worker_jobs_total", model=MODEL, outcome="dead_lettered")
    with Sender(gateway, auth, MODEL) as sender, health_watched(worker) as health:
        assert sender.send(Hostile("warm-up", {}, 1)).status_code == 200
        refused_ms = []
        for case in REFUSED:
            began = time.perf_counter()
            check(sender.send(case), case, "sim")
            refused_ms.append((time.perf_counter() - began) * 1000)
        for case in [*ADMITTED, TOO_COMPLEX]:
            check(sender.send(case), case, "sim")
        # What the simulator is asked to build goes far past what max_tokens carries: it stops there.
        heavy = Hostile("200,000 characters in 2,000 tokens", _long_string(200_000), 2000)
        assert check(sender.send(heavy), heavy, "sim")["usage"]["completion_tokens"] == 2000
        cut = Hostile("1e9 characters or an integer, 3,000 tokens", ADMITTED[0].fields, 3000)
        finishes = {check(sender.send(cut, seed=seed), cut, "sim")["choices"][0]["finish_reason"] for seed in range(6)}
        assert finishes == {"stop", "length"}  # both branches taken, the long one cut at max_tokens
        # A reference the simulator cannot follow: its own 400, the job acked once.
        check(sender.send(NOWHERE), NOWHERE, "sim")
    health.assert_answered_throughout()
    assert metric(worker, "axon_worker_jobs_total", model=MODEL, outcome="invalid") == invalid_before + 1
    assert metric(worker, "axon_worker_jobs_total", model=MODEL, outcome="dead_lettered") == dead_before
    report(
        "hostile JSON schemas (simulator)",
        refused_at_admission=len(REFUSED),
        issue_29_refused_in_ms=round(refused_ms[0], 1),
        refusal_ms_median=round(sorted(refused_ms)[len(refused_ms) // 2], 1),
        refusal_ms_max=round(max(refused_ms), 1),
        answered_within_max_tokens=len(ADMITTED) + 1 + 1 + 6,  # with TOO_COMPLEX, heavy and cut's six
        health_asks=len(health.answers),
        health_slowest_ms=round(health.slowest_s * 1000, 1),
    )


def _long_string(chars: int) -> dict:
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "long", "schema": {"type": "string", "minLength": chars}},
        }
    }
