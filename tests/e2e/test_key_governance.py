"""Keys an operator governs, across three real gateway processes in front of one session manager
and one sim worker: expiry, a model allowlist with aliases, a token budget held under concurrent
requests, and changes made with `PATCH /admin/keys/{id}` and `axon keys update`; tenants' weights
set with `PUT /admin/tenants/{tenant}` and `axon tenants set`, and kept in Redis by the gateways."""

import asyncio
import datetime as dt
import math
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
import openai
import pytest
import redis
from openai import AsyncOpenAI, OpenAI

from services.cli.launcher import Service
from shared.names import Names
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import ADMIN_TOKEN, Stack
from tests.waiting import until, wait_for

pytestmark = pytest.mark.e2e

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ALIAS = "governed-alias"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gateways(stack: Stack, sessions: Service, gateway: Service) -> list[Service]:
    """Three gateway replicas in front of the same session manager."""
    extra = [stack.start(f"gateway:governed{i}", env={"AXON_SESSIONS_URL": sessions.url}) for i in (1, 2)]
    return [gateway, *extra]


@pytest.fixture(scope="module")
def alias(gateway: Service, gateways: list[Service], api_key: str):
    """An alias of the sim model, answered through every gateway (their services see a new alias
    within AXON_MODELS_CACHE_TTL_S), removed afterwards."""
    put = httpx.put(f"{gateway.url}/admin/models/aliases/{ALIAS}", json={"target": SIM_MODEL}, headers=ADMIN)
    assert put.status_code == 200, put.text
    wait_for(
        lambda: all(_chat(gw, api_key, ALIAS).status_code == 200 for gw in gateways),
        timeout_s=5,
        what=f"{ALIAS} answered through every gateway",
    )
    yield ALIAS
    httpx.delete(f"{gateway.url}/admin/models/aliases/{ALIAS}", headers=ADMIN)


# A key change reaches every gateway within a second (their key caches), here with a margin.
CHANGE_SEEN_S = 1.5


def everywhere(check: Callable[[Service], bool], gateways: list[Service], *, what: str) -> None:
    """Until `check` holds on every gateway, at most CHANGE_SEEN_S after the change."""
    wait_for(lambda: all(check(gw) for gw in gateways), timeout_s=CHANGE_SEEN_S, what=f"{what} on every gateway")


async def _all_answered(request: Callable[[int], Awaitable[bool]]) -> bool:
    return all([await request(i) for i in range(3)])


def _create(gateway: Service, **fields) -> dict:
    created = httpx.post(f"{gateway.url}/admin/keys", json={"name": "governed", **fields}, headers=ADMIN, timeout=10)
    assert created.status_code == 201, created.text
    return created.json()


def _chat(gw: Service, key: str, model: str = SIM_MODEL, **body) -> httpx.Response:
    return httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 3, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_a_key_expires_on_every_gateway_at_its_instant(gateways: list[Service]) -> None:
    expires_at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2.5)
    created = _create(gateways[0], expires_at=expires_at.isoformat())
    assert dt.datetime.fromisoformat(created["expires_at"]) == expires_at
    for gw in gateways:
        assert _chat(gw, created["key"]).status_code == 200
    time.sleep(max(0.0, (expires_at - dt.datetime.now(dt.UTC)).total_seconds()) + 0.05)
    for gw in gateways:
        refused = _chat(gw, created["key"])
        assert refused.status_code == 401
        error = refused.json()["error"]
        assert error["code"] == "key_expired" and error["type"] == "authentication_error", error
        assert "expired" in error["message"]
        # Every route, not only completions.
        assert (
            httpx.get(f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {created['key']}"}).status_code == 401
        )
    with pytest.raises(openai.AuthenticationError) as caught:
        OpenAI(base_url=f"{gateways[1].url}/v1", api_key=created["key"], max_retries=0).models.list()
    assert caught.value.code == "key_expired"
    listed = httpx.get(f"{gateways[0].url}/admin/keys", headers=ADMIN).json()["data"]
    assert next(k for k in listed if k["id"] == created["id"])["expires_at"] is not None
    # An operator can give the key more time.
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1)).isoformat()
    patched = httpx.patch(f"{gateways[2].url}/admin/keys/{created['id']}", json={"expires_at": later}, headers=ADMIN)
    assert patched.status_code == 200, patched.text
    everywhere(lambda gw: _chat(gw, created["key"]).status_code == 200, gateways, what="the key valid again")


def test_an_allowlist_resolves_aliases_both_ways_and_changes_apply_everywhere(
    gateways: list[Service], alias: str
) -> None:
    by_alias = _create(gateways[0], allowed_models=[alias])
    by_model = _create(gateways[0], allowed_models=[SIM_MODEL])
    for gw in gateways:
        for key in (by_alias["key"], by_model["key"]):
            for model in (SIM_MODEL, alias):
                answer = _chat(gw, key, model)
                assert answer.status_code == 200, (gw.name, model, answer.text)
                assert answer.json()["model"] == model
    refused = _chat(gateways[1], by_alias["key"], "another-model")
    assert refused.status_code == 403
    assert refused.json()["error"] == {
        "message": "This API key may not use model 'another-model'.",
        "type": "permission_error",
        "param": "model",
        "code": "model_not_allowed",
    }
    with pytest.raises(openai.PermissionDeniedError):
        OpenAI(base_url=f"{gateways[2].url}/v1", api_key=by_alias["key"], max_retries=0).chat.completions.create(
            model="another-model", messages=MESSAGES, max_tokens=2
        )

    # Narrowed with PATCH: every gateway refuses the model within a second, then allows it again.
    key_url = f"{gateways[2].url}/admin/keys/{by_model['id']}"
    patched = httpx.patch(key_url, json={"allowed_models": ["another-model"]}, headers=ADMIN)
    assert patched.status_code == 200 and patched.json()["allowed_models"] == ["another-model"]
    everywhere(
        lambda gw: _chat(gw, by_model["key"], alias).json().get("error", {}).get("code") == "model_not_allowed",
        gateways,
        what="the narrowed allowlist",
    )
    assert httpx.patch(key_url, json={"allowed_models": None}, headers=ADMIN).json()["allowed_models"] is None
    everywhere(lambda gw: _chat(gw, by_model["key"], "sim-model").status_code == 200, gateways, what="every model")


async def test_a_budget_holds_across_three_gateways_under_concurrent_requests(gateways: list[Service]) -> None:
    budget, max_tokens = 1500, 40
    created = _create(gateways[0], token_budget=budget, budget_period="day", rpm=100_000, tpm=10_000_000)
    clients = [
        AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=created["key"], max_retries=0, timeout=30) for gw in gateways
    ]
    # What one request reserves: its prompt estimate (⌈5 / 4⌉ + 4) and max_tokens.
    reservation = 6 + max_tokens
    used: list[int] = []
    refusals: list[openai.RateLimitError] = []

    async def request(i: int) -> bool:
        try:
            answer = await clients[i % 3].chat.completions.create(
                model=SIM_MODEL, messages=MESSAGES, max_tokens=max_tokens
            )
        except openai.RateLimitError as exc:
            refusals.append(exc)
            return False
        assert answer.usage is not None and answer.usage.completion_tokens == max_tokens
        assert answer.usage.total_tokens <= reservation
        used.append(answer.usage.total_tokens)
        return True

    waves = 0
    while any(await asyncio.gather(*(request(i) for i in range(24)))):
        waves += 1
        assert sum(used) <= budget + reservation, sum(used)
        assert waves < 20
    assert waves >= 2 and budget <= sum(used) <= budget + reservation, (waves, sum(used))

    refused = refusals[-1]
    assert refused.status_code == 429 and refused.code == "budget_exceeded"
    now = dt.datetime.now(dt.UTC)
    midnight = dt.datetime(now.year, now.month, now.day, tzinfo=dt.UTC) + dt.timedelta(days=1)
    retry_after = int(refused.response.headers["retry-after"])
    assert abs(retry_after - math.ceil((midnight - now).total_seconds())) <= 5
    # The usage recorded for the key is what the answers reported.
    deadline = time.monotonic() + 10
    while True:
        rows = httpx.get(f"{gateways[0].url}/admin/usage", params={"key_id": created["id"]}, headers=ADMIN).json()
        total = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows["data"])
        if total == sum(used) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert total == sum(used)
    # Listing models reserves nothing: it still works with the budget spent.
    assert len((await clients[2].models.list()).data) >= 1
    # A raised budget applies at once on every gateway.
    key_url = f"{gateways[1].url}/admin/keys/{created['id']}"
    assert httpx.patch(key_url, json={"token_budget": budget * 2}, headers=ADMIN).status_code == 200
    await until(lambda: _all_answered(request), timeout_s=CHANGE_SEEN_S, what="the raised budget on every gateway")


def test_admin_patch_validates_and_names_the_bad_field(gateway: Service) -> None:
    created = _create(gateway)
    key_url = f"{gateway.url}/admin/keys/{created['id']}"
    for body, param in (
        ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"allowed_models": []}, "allowed_models"),
        ({"token_budget": -5}, "token_budget"),
        ({"budget_period": "week"}, "budget_period"),
        ({"priority": None}, "priority"),
    ):
        refused = httpx.patch(key_url, json=body, headers=ADMIN)
        assert refused.status_code == 400, (body, refused.text)
        assert refused.json()["error"]["param"] == param and refused.json()["error"]["type"] == "invalid_request_error"
    assert httpx.patch(key_url, json={"rpm": 5}).status_code == 401
    missing = httpx.patch(f"{gateway.url}/admin/keys/key_0000000000000000", json={"rpm": 5}, headers=ADMIN)
    assert missing.status_code == 404
    patched = httpx.patch(key_url, json={"rpm": None, "tpm": 1234, "priority": 4, "name": "renamed"}, headers=ADMIN)
    assert patched.status_code == 200
    assert patched.json()["limits"] | {"rpm": None, "tpm": 1234, "priority": 4} == patched.json()["limits"]
    assert patched.json()["name"] == "renamed" and "key" not in patched.json()


def test_cli_creates_updates_and_lists_governed_keys(stack: Stack, gateways: list[Service]) -> None:
    env = stack.env({})

    def axon(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "services.cli.main", "keys", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    created = axon(
        "create", "--name", "cli-governed", "--expires-in", "30d", "--allow-models", "nothing-served",
        "--budget", "5000", "--budget-period", "day",
    )  # fmt: skip
    key = created.strip().splitlines()[-1]
    key_id = re.search(r"created (key_[0-9a-f]{16})", created).group(1)
    assert "budget=5000/day" in created and "models=nothing-served" in created
    assert _chat(gateways[0], key).json()["error"]["code"] == "model_not_allowed"
    updated = axon("update", key_id, "--all-models", "--budget", "none", "--no-expiry", "--rpm", "77")
    assert "budget=none" in updated and "models=all" in updated and "expires=never" in updated
    assert "rpm=77" in updated
    everywhere(lambda gw: _chat(gw, key).status_code == 200, gateways, what="the updated key")
    row = next(line for line in axon("list").splitlines() if line.startswith(key_id))
    assert re.search(r"\s77\s", row) and row.rstrip().endswith("all") and " active " in row
    bad = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "keys", "update", key_id, "--budget", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--budget" in bad.stderr


def _weights(stack: Stack) -> dict[str, str]:
    """The Redis hash of tenants' weights the scheduler reads."""
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        return client.hgetall(Names(stack.namespace).tenant_weights)
    finally:
        client.close()


def _listed(gateway: Service, tenant: str) -> dict | None:
    listed = httpx.get(f"{gateway.url}/admin/tenants", headers=ADMIN, timeout=10)
    assert listed.status_code == 200 and listed.json()["object"] == "list", listed.text
    return next((t for t in listed.json()["data"] if t["tenant"] == tenant), None)


def test_admin_tenants_set_and_list_weights_and_refuse_bad_ones(stack: Stack, gateways: list[Service]) -> None:
    tenant = f"fair-{time.monotonic_ns()}"
    _create(gateways[0], tenant=tenant)
    assert _listed(gateways[1], tenant) == {"object": "tenant", "tenant": tenant, "weight": 1.0, "keys": 1}
    url = f"{gateways[0].url}/admin/tenants/{tenant}"
    put = httpx.put(url, json={"weight": 3}, headers=ADMIN, timeout=10)
    assert put.status_code == 200, put.text
    assert put.json() == {"object": "tenant", "tenant": tenant, "weight": 3.0, "keys": 1}
    assert _weights(stack)[tenant] == "3"  # at once, before any sync
    assert _listed(gateways[2], tenant)["weight"] == 3.0

    json_headers = {**ADMIN, "content-type": "application/json"}
    for raw in ('{"weight": 0}', '{"weight": -1}', '{"weight": "abc"}', '{"weight": NaN}', '{"weight": Infinity}',
                '{"weight": 1000001}', '{"weight": null}', "{}"):  # fmt: skip
        refused = httpx.put(url, content=raw, headers=json_headers, timeout=10)
        assert refused.status_code == 400, (raw, refused.text)
        error = refused.json()["error"]
        assert error["param"] == "weight" and error["type"] == "invalid_request_error", (raw, error)
    extra = httpx.put(url, json={"weight": 2, "share": 0.5}, headers=ADMIN, timeout=10)
    assert extra.status_code == 400 and "share" in extra.json()["error"]["message"]
    too_long = httpx.put(f"{gateways[0].url}/admin/tenants/{'t' * 129}", json={"weight": 2}, headers=ADMIN)
    assert too_long.status_code == 400
    assert httpx.put(url, json={"weight": 2}).status_code == 401
    assert httpx.get(f"{gateways[0].url}/admin/tenants").status_code == 401
    assert _listed(gateways[0], tenant)["weight"] == 3.0 and _weights(stack)[tenant] == "3"  # nothing changed

    # Redis lost the hash (a restart without its data): the gateways' sync writes it back.
    client = redis.Redis.from_url(stack.redis_url)
    try:
        client.delete(Names(stack.namespace).tenant_weights)
    finally:
        client.close()
    deadline = time.monotonic() + 10  # AXON_TENANT_WEIGHTS_SYNC_S is 5 s
    while _weights(stack).get(tenant) != "3":
        assert time.monotonic() < deadline, "no gateway wrote the weights back"
        time.sleep(0.2)


def test_cli_sets_and_lists_tenants_weights(stack: Stack, gateway: Service) -> None:
    tenant = f"cli-fair-{time.monotonic_ns()}"

    def axon(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli.main", "tenants", *args],
            env=stack.env({}),
            capture_output=True,
            text=True,
            timeout=60,
        )

    done = axon("set", tenant, "--weight", "0.5")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"{tenant} weight=0.5 keys=0"
    assert _weights(stack)[tenant] == "0.5"
    assert _listed(gateway, tenant)["weight"] == 0.5
    # Each refusal is unit-tested (tests/unit/cli/test_tenants_command.py); one here, as a process.
    refused = axon("set", tenant, "--weight", "0")
    assert refused.returncode == 2 and "weight" in refused.stderr and refused.stdout == ""
    listed = axon("list")
    assert listed.returncode == 0 and listed.stdout.splitlines()[0].split() == ["tenant", "weight", "keys"]
    row = next(line for line in listed.stdout.splitlines() if line.startswith(tenant + " "))
    assert row.split() == [tenant, "0.5", "0"]
    assert _weights(stack)[tenant] == "0.5"
