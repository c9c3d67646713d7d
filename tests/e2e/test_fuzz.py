"""Hostile input: schemathesis over the gateway's own OpenAPI schema, with and without a key.

Every generated request (valid bodies, and bodies that break the schema) must get an answer in
time, never a 5xx, every error in OpenAI's shape, every response as the schema documents it; with
no key, every /v1/* route answers 401. Deterministic (derandomized) and bounded (a few dozen
examples per operation and generation mode).

The schema is fetched from the running gateway, so the operations are known only at run time:
each test drives Hypothesis over every operation itself (schemathesis' lazy pytest integration,
`schemathesis.pytest.from_fixture`, does not work with pytest 9) and reports every failing
operation at once.
"""

import asyncio
import hashlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable

import asyncpg
import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_schema_conformance,
    status_code_conformance,
)

from services.cli.launcher import Service
from shared.keys import KeyLimits
from tests.conftest import create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.load import report
from tests.e2e.stack import ADMIN_TOKEN

pytestmark = pytest.mark.e2e

MAX_EXAMPLES = 50
# Per request. The slowest legitimate answer is a sim generation of at most `_MAX_SIM_TOKENS`.
TIMEOUT_S = 10
_MAX_SIM_TOKENS = 8
ERROR_KEYS = {"message", "type", "param", "code"}
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    # No shrinking: it would make a failing run's length unbounded; the failing case is printed as curl.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)


@pytest.fixture(scope="module")
def fuzz_key(database_url: str) -> str:
    """A key of its own tenant, so the sessions the fuzz creates stay out of other tests' listings."""
    limits = KeyLimits(rpm=1_000_000, tpm=100_000_000, max_concurrent=10_000)
    return asyncio.run(create_key(database_url, name="fuzz", limits=limits, tenant="fuzz"))


@pytest.fixture(scope="module")
def gateway_schema(gateway: Service) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    # /health, /ready and /metrics take no input (and are covered elsewhere).
    return schema.include(path_regex="^/v1/")


def fuzz(schema: schemathesis.BaseSchema, check: Callable[[schemathesis.Case], None], *, max_examples: int) -> None:
    """Run `check` on generated cases of every operation, valid and invalid ones; fail listing
    every operation that failed, with its first failure."""
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9, [op.label for op in operations]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(FUZZ_SETTINGS, max_examples=max_examples)
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: schemathesis.Case) -> None:
                check(case)

            try:
                run()
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collected, reported below
                failures.append(f"{operation.label} ({mode.value}): {type(exc).__name__}: {exc}")
    assert not failures, "\n\n".join(failures)


def _some_to_the_sim_model(case: schemathesis.Case) -> None:
    """Send about half of the completion bodies that name a model to the one a worker serves, with
    a short answer, so the fuzz reaches generation and streaming too, not only "model not found"."""
    body = case.body
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return
    if hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=1).digest()[0] % 2:
        return
    body["model"] = SIM_MODEL
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and not isinstance(body.get(field), bool) and body[field] > _MAX_SIM_TOKENS:
            body[field] = _MAX_SIM_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = _MAX_SIM_TOKENS


def _assert_openai_error(response: requests.Response) -> None:
    try:
        body = response.json()
    except ValueError:
        pytest.fail(f"{response.status_code} without a JSON body: {response.text[:200]!r}")
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


def _call(case: schemathesis.Case, gateway: Service, headers: dict[str, str]) -> requests.Response:
    try:
        return case.call(base_url=gateway.url, headers=headers, timeout=TIMEOUT_S)
    except requests.Timeout:
        pytest.fail(f"no answer within {TIMEOUT_S} s: {case.as_curl_command()}")


# Every operation of the document, in one test: past the default timeout on a loaded machine.
@pytest.mark.timeout(600)
def test_fuzz_with_key(gateway_schema: schemathesis.BaseSchema, gateway: Service, fuzz_key: str) -> None:
    headers = {"Authorization": f"Bearer {fuzz_key}"}
    statuses: Counter[int] = Counter()

    def check(case: schemathesis.Case) -> None:
        _some_to_the_sim_model(case)
        # Always the valid key (schemathesis may generate an Authorization of its own);
        # `ignored_auth` below re-sends each case with no key and with a wrong one.
        case.headers = {**(case.headers or {}), **headers}
        response = _call(case, gateway, headers)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (
            f"{response.status_code} {response.text[:500]}\n{case.as_curl_command(headers)}"
        )
        if response.status_code >= 400:
            _assert_openai_error(response)
        case.validate_response(
            response,
            checks=[status_code_conformance, content_type_conformance, response_schema_conformance, ignored_auth],
            headers=headers,
            transport_kwargs={"base_url": gateway.url, "timeout": TIMEOUT_S},
        )

    fuzz(gateway_schema, check, max_examples=MAX_EXAMPLES)
    _report("fuzz with a key", statuses)


@pytest.mark.timeout(600)
def test_fuzz_without_key_is_always_401(gateway_schema: schemathesis.BaseSchema, gateway: Service) -> None:
    statuses: Counter[int] = Counter()

    def check(case: schemathesis.Case) -> None:
        for headers in ({}, {"Authorization": "Bearer axk_not-a-real-key-000000000000000000000000"}):
            response = _call(case, gateway, headers)
            statuses[response.status_code] += 1
            assert response.status_code == 401, (
                f"{response.status_code} {response.text[:500]}\n{case.as_curl_command()}"
            )
            _assert_openai_error(response)
            assert response.json()["error"]["type"] == "authentication_error"

    fuzz(gateway_schema, check, max_examples=MAX_EXAMPLES // 2)
    _report("fuzz without a key or with a wrong one", statuses)


def _report(fault: str, statuses: Counter[int]) -> None:
    """The generated requests' status codes (a case may be answered more than once: Hypothesis
    replays, and the with-key checks re-send it)."""
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    report(
        fault,
        checked=statuses.total(),
        server_errors=server_errors,
        hung=0,
        statuses={str(k): v for k, v in sorted(statuses.items())},
    )


# Regressions: what the fuzz found, pinned down as plain cases.


@pytest.fixture(scope="module")
def fuzz_api(gateway: Service, fuzz_key: str) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {fuzz_key}"}, timeout=TIMEOUT_S)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/sessions/%0F",
        "/v1/sessions/%0A%C2%85/messages",
        "/v1/sessions/%2E%2E/messages",
        "/v1/sessions/%2E",
        "/v1/sessions/a%25b",
    ],
)
def test_odd_session_ids_reach_their_own_route_as_one_parameter(fuzz_api: httpx.Client, path: str) -> None:
    """Percent-escapes in a path parameter used to be decoded into the forwarded URL: control
    characters made it invalid (500), `..` was normalised into another path."""
    response = fuzz_api.get(path)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "session_not_found", response.text


def test_text_parts_that_are_not_strings_are_a_400(fuzz_api: httpx.Client) -> None:
    """The gateway's prompt-token estimate used to crash (500) on a non-string `text` part."""
    for text in (1.5, ["a"], {"a": 1}, True):
        body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
        response = fuzz_api.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        _assert_openai_error(response)


def test_nul_in_session_fields_is_a_400_naming_the_field(fuzz_api: httpx.Client) -> None:
    """PostgreSQL's text cannot hold U+0000: the INSERT used to fail (500)."""
    for field in ("title", "system_prompt", "model"):
        response = fuzz_api.post("/v1/sessions", json={field: "a\u0000b"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
    session_id = fuzz_api.post("/v1/sessions", json={"title": "fine"}).json()["id"]
    response = fuzz_api.patch(f"/v1/sessions/{session_id}", json={"title": "\u0000"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "title", response.text


async def _stored_contents(database_url: str, session_id: str) -> list[str]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT content FROM messages WHERE conversation_id = $1 ORDER BY seq", uuid.UUID(session_id)
        )
        return [r["content"] for r in rows]
    finally:
        await conn.close()


def test_nul_in_a_chat_message_does_not_stop_persistence(fuzz_api: httpx.Client, database_url: str) -> None:
    """One message with U+0000 used to fail its whole outbox batch for ever: from then on nothing,
    from any tenant, reached PostgreSQL. It is stored with U+FFFD in its place."""
    session_id = fuzz_api.post("/v1/sessions", json={}).json()["id"]
    for content in ("a\u0000b", "after"):
        body = {
            "model": SIM_MODEL,
            "session_id": session_id,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": content}],
        }
        response = fuzz_api.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10
    while len(stored := asyncio.run(_stored_contents(database_url, session_id))) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(stored) == 4, stored
    assert stored[0] == "a\ufffdb" and stored[2] == "after"


def test_a_key_limit_beyond_the_database_column_is_a_400(gateway: Service) -> None:
    """The admin API used to pass a limit above PostgreSQL's integer range to the INSERT (a 500)."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for field in ("rpm", "tpm", "max_concurrent"):
        response = httpx.post(
            f"{gateway.url}/admin/keys", json={"name": "huge", field: 10**12}, headers=admin, timeout=TIMEOUT_S
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
