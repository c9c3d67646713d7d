"""API keys, the admin API and per-key rate limits, across real gateway processes."""

import asyncio
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from openai import OpenAI

from services.cli.launcher import Service, free_port
from shared.keys import KeyLimits
from tests.conftest import create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import ADMIN_TOKEN, INTERNAL_AUTH, Stack
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "hello"}]


def _key(database_url: str, **limits) -> str:
    return asyncio.run(create_key(database_url, name="limits-test", limits=KeyLimits(**limits)))


@pytest.fixture(scope="module")
def gateways(stack: Stack, sessions: Service, gateway: Service) -> list[Service]:
    """Three gateway replicas in front of the same session manager."""
    extra = [stack.start(f"gateway:replica{i}", env={"AXON_SESSIONS_URL": sessions.url}) for i in (1, 2)]
    return [gateway, *extra]


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer axk_not-a-real-key-000000000000000000000000", "Basic dXNlcjpwYXNz", "Bearer sk-openai-style"],
)
def test_missing_or_wrong_key_is_401(gateway: Service, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": SIM_MODEL, "messages": MESSAGES},
        headers=headers,
        timeout=10,
    )
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"


def test_health_and_ready_need_no_key_and_metrics_the_internal_token(gateway: Service, api_key: str) -> None:
    for path in ("/health", "/ready"):
        assert httpx.get(f"{gateway.url}{path}", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": f"Bearer {api_key}"}):
        assert httpx.get(f"{gateway.url}/metrics", headers=headers, timeout=10).status_code == 401
    assert httpx.get(f"{gateway.url}/metrics", headers=INTERNAL_AUTH, timeout=10).status_code == 200


def test_cli_creates_lists_and_revokes_keys_effective_within_a_second(stack: Stack, gateways: list[Service]) -> None:
    env = stack.env({})
    created = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "keys",
            "create",
            "--name",
            "cli-test",
            "--rpm",
            "1000",
            "--priority",
            "3",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    key = created.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"axk_[A-Za-z0-9_\-]{32,}", key)
    listing = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "keys", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert key not in listing and f"{key[:6]}…{key[-4:]}" in listing
    key_id = re.search(r"(key_[0-9a-f]{16})\s+cli-test", listing).group(1)

    headers = {"Authorization": f"Bearer {key}"}
    for gw in gateways:
        assert httpx.get(f"{gw.url}/v1/models", headers=headers, timeout=10).status_code == 200
    subprocess.run(
        [sys.executable, "-m", "services.cli.main", "keys", "revoke", key_id], env=env, check=True, timeout=60
    )
    # Refused by every gateway within a second of the revocation (their key caches), with a margin.
    wait_for(
        lambda: all(
            httpx.get(f"{gw.url}/v1/models", headers=headers, timeout=10).status_code == 401 for gw in gateways
        ),
        timeout_s=1.5,
        what="the revoked key refused by every gateway",
    )


def test_admin_api_needs_the_admin_token_and_shows_a_key_once(gateway: Service) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert httpx.get(f"{gateway.url}/admin/keys", timeout=10).status_code == 401
    assert (
        httpx.get(
            f"{gateway.url}/admin/keys", headers={"Authorization": "Bearer wrong-token-wrong-token"}, timeout=10
        ).status_code
        == 401
    )
    created = httpx.post(f"{gateway.url}/admin/keys", json={"name": "via-admin", "rpm": 50}, headers=admin, timeout=10)
    assert created.status_code == 201
    body = created.json()
    key = body["key"]
    assert body["limits"]["rpm"] == 50 and body["limits"]["tpm"]  # unspecified limits get defaults
    listed = httpx.get(f"{gateway.url}/admin/keys", headers=admin, timeout=10)
    assert key not in listed.text and body["id"] in listed.text
    assert (
        httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200
    )
    assert httpx.delete(f"{gateway.url}/admin/keys/{body['id']}", headers=admin, timeout=10).status_code == 200
    assert httpx.delete(f"{gateway.url}/admin/keys/{body['id']}", headers=admin, timeout=10).status_code == 404


@pytest.mark.parametrize("token", [None, "changeme", "short"])
def test_gateway_refuses_to_start_without_a_strong_admin_token(stack: Stack, token: str | None) -> None:
    env = stack.env({"AXON_GATEWAY_PORT": str(free_port())})
    env.pop("AXON_ADMIN_TOKEN")
    if token is not None:
        env["AXON_ADMIN_TOKEN"] = token
    result = subprocess.run(
        [sys.executable, "-m", "services.gateway.main"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "AXON_ADMIN_TOKEN" in result.stderr


async def test_request_limit_holds_across_three_gateways(gateways: list[Service], database_url: str) -> None:
    limit = 100
    key = await create_key(database_url, name="three-gateways", limits=KeyLimits(rpm=limit))
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=10) as client:
        started = time.monotonic()
        responses = await asyncio.gather(
            *(client.get(f"{gateways[i % 3].url}/v1/models", headers=headers) for i in range(2 * limit))
        )
        elapsed = time.monotonic() - started
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(accepted) + len(refused) == 2 * limit
    # GCRA: a full minute's budget at once, then one more every 60/limit seconds while requests
    # keep arriving. The last decision came at most `elapsed` after the start (on a loaded machine
    # well before the last response), so the exact count lies between these two bounds.
    tolerance = max(2, 0.02 * limit)
    most = limit + elapsed * limit / 60
    assert limit - tolerance <= len(accepted) <= most + tolerance, (len(accepted), limit, most)
    sample = refused[-1]
    assert sample.json()["error"]["code"] == "rate_limit_exceeded"
    assert sample.headers["x-ratelimit-limit-requests"] == str(limit)
    assert sample.headers["x-ratelimit-remaining-requests"] == "0"
    retry_ms = int(sample.headers["retry-after-ms"])
    assert 0 < retry_ms <= 60_000 / limit + 50
    assert int(sample.headers["retry-after"]) == -(-retry_ms // 1000)
    ok = accepted[0]
    assert ok.headers["x-ratelimit-limit-requests"] == str(limit)
    assert re.fullmatch(r"[0-9.]+m?s|\d+m\d+s", ok.headers["x-ratelimit-reset-requests"])


def test_openai_client_retries_through_a_429_on_its_own(gateway: Service, database_url: str) -> None:
    key = _key(database_url, rpm=30)  # one request every 2 s once the burst is spent
    headers = {"Authorization": f"Bearer {key}"}
    statuses: list[int] = []  # the burst spent: on a busy machine, one more passes every 2 s of asking
    while statuses.count(429) < 4:
        assert len(statuses) < 60, statuses
        statuses.append(httpx.get(f"{gateway.url}/v1/models", headers=headers, timeout=10).status_code)
    assert statuses[:30] == [200] * 30
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=3, timeout=30)
    started = time.monotonic()
    response = client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=2)
    assert response.choices[0].finish_reason == "length"
    assert time.monotonic() - started < 6
    with pytest.raises(openai.RateLimitError):
        OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30).models.list()


async def test_concurrency_limit_refuses_the_extra_stream(gateway: Service, database_url: str) -> None:
    key = await create_key(database_url, name="concurrency", limits=KeyLimits(max_concurrent=2))
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 60, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:

        async def stream() -> int:
            async with client.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers) as r:
                await r.aread()
                return r.status_code

        running = [asyncio.create_task(stream()) for _ in range(2)]
        await asyncio.sleep(0.2)
        extra = await client.post(f"{gateway.url}/v1/chat/completions", json={**body, "stream": False}, headers=headers)
        assert extra.status_code == 429
        assert "concurrent" in extra.json()["error"]["message"]
        assert await asyncio.gather(*running) == [200, 200]
        again = await client.post(f"{gateway.url}/v1/chat/completions", json={**body, "stream": False}, headers=headers)
        assert again.status_code == 200


async def test_a_stream_its_client_abandons_gives_its_concurrency_back(gateway: Service, database_url: str) -> None:
    key = await create_key(database_url, name="abandoned", limits=KeyLimits(max_concurrent=1))
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for _line in r.aiter_lines():
                break  # the first event arrived: hang up mid-answer
        # The gateway and the session manager both let go of the lease; the slot is free again.
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            again = await client.post(
                f"{gateway.url}/v1/chat/completions", json={**body, "max_tokens": 2, "stream": False}, headers=headers
            )
            if again.status_code == 200:
                break
            assert again.status_code == 429 and asyncio.get_running_loop().time() < deadline, again.text
            await asyncio.sleep(0.1)


def test_token_limit_counts_prompt_estimate_and_real_usage(gateway: Service, database_url: str) -> None:
    key = _key(database_url, tpm=300)
    headers = {"Authorization": f"Bearer {key}"}
    huge = [{"role": "user", "content": "x" * 2000}]  # ~500 tokens: more than the whole budget
    too_large = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": SIM_MODEL, "messages": huge}, headers=headers, timeout=10
    )
    assert too_large.status_code == 400 and too_large.json()["error"]["code"] == "request_too_large_for_limit"
    statuses = []
    for _ in range(10):
        r = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 50},
            headers=headers,
            timeout=10,
        )
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.headers["x-ratelimit-remaining-tokens"] == "0" or "tokens" in r.json()["error"]["message"]
            break
    # Each answer really costs ~55 tokens (charged after it finishes): the budget runs out by the 6th.
    assert 429 in statuses and statuses.index(429) <= 6


@pytest.mark.parametrize("fail_open", [False, True])
def test_redis_unreachable_auth_falls_back_and_limiter_follows_setting(
    stack: Stack, sessions: Service, api_key: str, fail_open: bool
) -> None:
    lonely = stack.start(
        f"gateway:no-redis-{'open' if fail_open else 'closed'}",
        env={
            "AXON_SESSIONS_URL": sessions.url,
            "AXON_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "AXON_RATE_LIMIT_FAIL_OPEN": str(fail_open).lower(),
            "AXON_CONNECT_TIMEOUT_S": "0.5",
        },
        ready_path="/health",
    )
    response = httpx.post(
        f"{lonely.url}/v1/chat/completions",
        json={"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 2},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    )
    metrics = httpx.get(f"{lonely.url}/metrics", headers=INTERNAL_AUTH, timeout=10).text
    assert "axon_gateway_auth_database_fallbacks_total 1.0" in metrics
    if fail_open:
        assert response.status_code == 200
        assert 'axon_gateway_rate_limiter_unavailable_total{mode="open"} 1.0' in metrics
    else:
        assert response.status_code == 503 and response.headers["retry-after"]
        assert 'axon_gateway_rate_limiter_unavailable_total{mode="closed"} 1.0' in metrics


def test_usage_is_recorded_per_key_and_summed_by_day(gateway: Service, database_url: str) -> None:
    key = asyncio.run(create_key(database_url, name="usage", limits=KeyLimits(), tenant="usage-tenant"))
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)
    answers = [client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=n) for n in (3, 5)]
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    key_id = next(
        k["id"]
        for k in httpx.get(f"{gateway.url}/admin/keys", headers=admin, timeout=10).json()["data"]
        if k["name"] == "usage"
    )
    deadline = time.monotonic() + 10
    while True:
        rows = httpx.get(f"{gateway.url}/admin/usage", params={"key_id": key_id}, headers=admin, timeout=10).json()[
            "data"
        ]
        if rows and rows[0]["requests"] == 2:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
    assert rows[0]["completion_tokens"] == 8
    assert rows[0]["prompt_tokens"] == sum(a.usage.prompt_tokens for a in answers)


async def test_a_burst_stays_within_its_tokens_per_minute(gateway: Service, database_url: str) -> None:
    """Issue 29's burst, scaled down: 24 concurrent requests for `n` 8 choices of a key with `tpm`
    2000. Admission reserves each request's most (its prompt estimate and `n` x `max_tokens`), so
    the tokens the burst generates stay within docs/keys.md's bound: tpm x (1 + T / 60 s), T the
    burst's length."""
    tpm = 2000
    key = await create_key(database_url, name="tpm-burst", limits=KeyLimits(tpm=tpm))
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=60) as client:

        async def burst(max_tokens: int) -> tuple[list[httpx.Response], float]:
            body = {"model": SIM_MODEL, "messages": MESSAGES, "n": 8, "max_tokens": max_tokens}
            started = time.monotonic()
            answers = await asyncio.gather(
                *(client.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers) for _ in range(24))
            )
            return answers, time.monotonic() - started

        # 8 x 300 tokens is more than the key may use in a minute: no such request can ever run.
        answers, _ = await burst(300)
        assert {a.status_code for a in answers} == {400}
        assert {a.json()["error"]["code"] for a in answers} == {"request_too_large_for_limit"}
        # 8 x 50 tokens fits: as many run as the minute's tokens allow, the others wait their turn.
        answers, elapsed_s = await burst(50)
    admitted = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    generated = sum(a.json()["usage"]["completion_tokens"] for a in admitted)
    bound = tpm * (1 + elapsed_s / 60)
    print(
        f"\nTPM {tpm}: 24 x n 8 x max_tokens 50 in {elapsed_s:.2f} s: {len(admitted)} admitted, "
        f"{len(refused)} refused, {generated} tokens generated (bound {bound:.0f})"
    )
    assert len(admitted) + len(refused) == 24 and admitted, [a.text for a in answers if a.status_code != 200]
    assert generated <= bound
    assert {"tokens" in a.json()["error"]["message"] for a in refused} == {True}
    retry_s = int(refused[0].headers["retry-after"])
    assert 1 <= retry_s <= 60
