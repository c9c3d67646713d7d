"""The trust boundary: only gateways hold the internal token. The session manager and the workers
refuse forged identity headers, refuse to start without the token, and the gateway drops every
`x-axon-*` header a client sends."""

import asyncio
import subprocess
import sys

import httpx
import pytest

from services.cli.launcher import Service
from shared.keys import KeyLimits
from tests.conftest import create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import INTERNAL_AUTH, Stack

FORGED = {"x-axon-tenant": "tests", "x-axon-key-id": "key_forged", "x-axon-priority": "9"}
CHAT = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
LIMITS = KeyLimits(rpm=1000, tpm=1_000_000, max_concurrent=100)


def _assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_internal_token")


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token-0123456789abcdef0123456789", f"Bearer {INTERNAL_AUTH['authorization'][7:-1]}"],
    ids=["none", "wrong", "one-character-short"],
)
def test_forged_identity_headers_are_refused_by_the_session_manager(
    sessions: Service, authorization: str | None
) -> None:
    headers = dict(FORGED) | ({"authorization": authorization} if authorization else {})
    with httpx.Client(base_url=sessions.url, headers=headers, timeout=10) as client:
        _assert_refused(client.post("/v1/chat/completions", json=CHAT))
        _assert_refused(client.post("/v1/sessions", json={}))
        _assert_refused(client.get("/v1/models"))
        _assert_refused(client.get("/metrics"))
        # Orchestrators' probes need no credential and say nothing about any tenant.
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200


def test_the_worker_answers_only_probes_without_the_token(sim_worker: Service) -> None:
    assert httpx.get(f"{sim_worker.url}/health", timeout=10).status_code == 200
    _assert_refused(httpx.get(f"{sim_worker.url}/metrics", timeout=10))
    assert httpx.get(f"{sim_worker.url}/metrics", headers=INTERNAL_AUTH, timeout=10).status_code == 200


def test_the_token_opens_the_session_manager(sessions: Service) -> None:
    response = httpx.post(f"{sessions.url}/v1/sessions", json={}, headers=FORGED | INTERNAL_AUTH, timeout=10)
    assert response.status_code == 201, response.text


def test_the_gateway_drops_identity_headers_a_client_sends(gateway: Service, database_url: str) -> None:
    """A key of tenant B that claims tenant A's identity in x-axon-* headers still acts as tenant B."""
    owner = asyncio.run(create_key(database_url, name="trust-owner", limits=LIMITS, tenant="trust-a"))
    intruder = asyncio.run(create_key(database_url, name="trust-intruder", limits=LIMITS, tenant="trust-b"))
    with httpx.Client(base_url=f"{gateway.url}/v1", timeout=10) as client:
        created = client.post("/sessions", json={}, headers={"authorization": f"Bearer {owner}"})
        assert created.status_code == 201, created.text
        session = created.json()["id"]
        forged = {"authorization": f"Bearer {intruder}", "x-axon-tenant": "trust-a", "x-axon-key-id": "key_x"}
        assert client.get(f"/sessions/{session}/messages", headers=forged).status_code == 404
        answer = client.post("/chat/completions", json=CHAT, headers=forged | {"x-axon-priority": "9"})
        assert answer.status_code == 200, answer.text
        assert client.get(f"/sessions/{session}/messages", headers={"authorization": f"Bearer {owner}"}).is_success


@pytest.mark.parametrize(
    ("service", "token"),
    [("sessions", None), ("worker", "short-token"), ("gateway", None)],
)
def test_a_service_without_the_internal_token_refuses_to_start(stack: Stack, service: str, token: str | None) -> None:
    env = stack.env({"AXON_ENGINE": "sim", "AXON_MODEL": SIM_MODEL, "AXON_INTERNAL_TOKEN": token or ""})
    done = subprocess.run(
        [sys.executable, "-m", f"services.{service}.main"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "AXON_INTERNAL_TOKEN" in done.stdout + done.stderr
