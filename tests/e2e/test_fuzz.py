"""Hostile input: schemathesis over the gateway's own OpenAPI schema, with and without a key.

Every generated request (valid bodies, and bodies that break the schema) must get an answer in
time, never a 5xx, every error in OpenAI's shape (Anthropic's on its Messages routes), every
response as the schema documents it; with
a key, what the schema accepts is accepted (or refused for a reason the schema cannot know: an
unknown model, session or response is a 404) and what it refuses is refused, and a method a path
does not have is a 405 whose `Allow` lists the ones it has; with no key, every /v1/* route answers
401. Deterministic (derandomized) and bounded (a few dozen examples per operation and generation
mode).

A valid case is adjusted before it is sent where the API refuses, by design, what the schema
cannot say (`_prepare`): the rest is as generated.

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
from typing import Any, get_args

import asyncpg
import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.errors import InvalidSchema
from schemathesis.generation.meta import CoverageScenario
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from services.cli.launcher import Service
from shared.keys import KeyLimits
from shared.schemas import Capability
from tests.conftest import create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.load import report
from tests.e2e.stack import ADMIN_TOKEN, INTERNAL_AUTH

# The fuzz is bounded by its number of examples, not by time: on two cores with a load average of 8
# the with-key fuzz alone took 120 to 140 s (the whole module takes about 60 s on an idle machine),
# which pytest's default timeout of 120 s cut; each request still has its own TIMEOUT_S.
# `alone` (make test runs it with no other test beside it):
# generating its cases keeps a core busy for minutes, and each request has its own timeout.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.alone]

MAX_EXAMPLES = 50
# Per request: the slowest legitimate answer is a sim generation of at most `_MAX_SIM_TOKENS` for
# each of at most `_MAX_CHOICES` choices (well under a second); the margin is for a loaded machine.
TIMEOUT_S = 30
_MAX_SIM_TOKENS = 8
# The stack's AXON_MAX_CHOICES (its default): `n` above it is a 400 the schema cannot know of.
_MAX_CHOICES = 8
# The operations whose bodies name a model and ask for tokens, and the field that bounds them.
_COMPLETIONS = {
    "/v1/chat/completions": "max_completion_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
}
# An operation whose body names a model but asks for no tokens of answer.
_COUNTS = {"/v1/messages/count_tokens"}
# Anthropic's routes: their bodies, their errors' shape.
_ANTHROPIC = ("/v1/messages",)
# A Messages body's fields that are an engine capability of another name.
_MESSAGES_CAPABILITIES = {"stop_sequences": "stop", "top_k": "top_k"}
ERROR_KEYS = {"message", "type", "param", "code"}
_ANTHROPIC_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "timeout_error",
    "overloaded_error",
}
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


@pytest.fixture(scope="module")
def sim_capabilities(gateway: Service, fuzz_key: str) -> frozenset[str]:
    """The request parameters the sim worker's engine honours (`GET /v1/models/{id}`, once its
    worker is listed)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        response = httpx.get(
            f"{gateway.url}/v1/models/{SIM_MODEL}", headers={"Authorization": f"Bearer {fuzz_key}"}, timeout=TIMEOUT_S
        )
        if response.status_code != 404 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    response.raise_for_status()
    return frozenset(response.json()["capabilities"])


def fuzz(schema: schemathesis.BaseSchema, check: Callable[[schemathesis.Case], None], *, max_examples: int) -> None:
    """Run `check` on generated cases of every operation, valid and invalid ones; fail listing
    every operation that failed, with its first failure."""
    failures: list[str] = []
    # In one order every run (schemathesis' varies): what one case creates, another may list.
    operations = sorted((result.ok() for result in schema.get_all_operations()), key=lambda op: op.label)
    assert len(operations) >= 9, [op.label for op in operations]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(FUZZ_SETTINGS, max_examples=max_examples)
            @given(case=_cases(operation, mode))
            def run(case: schemathesis.Case) -> None:
                check(case)

            try:
                run()
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collected, reported below
                failures.append(f"{operation.label} ({mode.value}): {_described(exc)}")
    assert not failures, "\n\n".join(failures)


def _cases(operation: Any, mode: GenerationMode) -> st.SearchStrategy[schemathesis.Case]:
    """The operation's cases in `mode`. A negative case is drawn from a schema schemathesis mutated,
    which it sometimes cannot draw from (`InvalidSchema`: "Cannot generate an array with 1 demanded
    elements", from a mutated Messages content block): that draw is rejected and another one made,
    instead of ending the operation's run as a failure of ours. Whether a run's draws hit it
    follows Hypothesis' seed: with seed 3 of 40 it did, and one run of this module here failed so
    while others passed. A positive case is drawn from our own document: its InvalidSchema is a
    failure."""
    strategy = operation.as_strategy(generation_mode=mode)
    if mode is not GenerationMode.NEGATIVE:
        return strategy

    @st.composite
    def drawable(draw: st.DrawFn) -> schemathesis.Case:
        try:
            return draw(strategy)
        except InvalidSchema:
            reject()

    return drawable()


def _described(exc: BaseException) -> str:
    """`exc` and, for a group (Hypothesis' FlakyFailure, schemathesis' FailureGroup), what it holds."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, BaseExceptionGroup):
        text += "".join(f"\n  - {_described(inner)}" for inner in exc.exceptions)
    return text


def _prepare(case: schemathesis.Case, sim_capabilities: frozenset[str]) -> None:
    """The case as it is sent: integers as integers, some to the sim model, and a case that is then
    valid (as generated, or made so: schemathesis judges the body sent) within what no schema says.
    A multipart body (a file upload) gets its `file` moved last: the form's order, which the API
    needs and no schema can say (docs/api-compatibility.md, Files)."""
    if case.media_type == "multipart/form-data":
        if isinstance(case.body, dict) and "file" in case.body:
            case.body = {**{k: v for k, v in case.body.items() if k != "file"}, "file": case.body["file"]}
        return
    if case.media_type != "application/json":
        return
    case.body = _integers_as_integers(case.body)
    to_the_sim = _some_to_the_sim_model(case)
    if not (_is_positive(case) and isinstance(case.body, dict)):
        return
    if case.path == "/v1/messages/batches":
        _distinct_custom_ids(case.body)
    elif case.path.startswith(_ANTHROPIC):
        _messages_within_what_no_schema_says(case.body)
        if to_the_sim:
            for field, capability in _MESSAGES_CAPABILITIES.items():
                if capability not in sim_capabilities:
                    case.body.pop(field, None)
    elif case.path in _COMPLETIONS:
        _within_what_no_schema_says(case.body, chat=case.path == "/v1/chat/completions")
        if to_the_sim:
            # What its engine does not honour is a 400 `unsupported_parameter`: the model's, not the body's.
            for field in _CAPABILITY_FIELDS - sim_capabilities:
                case.body.pop(field, None)


def _distinct_custom_ids(body: dict[str, Any]) -> None:
    """A valid message batch's requests with distinct `custom_id`s (each prefixed with its index),
    as Anthropic's API requires and no JSON Schema can say (docs/batch.md)."""
    requests = body.get("requests")
    for index, request in enumerate(requests if isinstance(requests, list) else []):
        if isinstance(request, dict) and isinstance(request.get("custom_id"), str):
            request["custom_id"] = f"{index}-{request['custom_id']}"[:64]


def _some_to_the_sim_model(case: schemathesis.Case) -> bool:
    """Send about half of the completion bodies that name a model to the one a worker serves, with
    a short answer, so the fuzz reaches generation and streaming too, not only "model not found"."""
    body = case.body
    if case.path not in _COMPLETIONS.keys() | _COUNTS or not isinstance(body, dict):
        return False
    if not isinstance(body.get("model"), str):
        return False
    if hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=1).digest()[0] % 2:
        return False
    body["model"] = SIM_MODEL
    if case.path in _COUNTS:
        return True
    bounds = [field for field in ("max_tokens", "max_completion_tokens", "max_output_tokens") if field in body]
    for field in bounds:
        if _is_int(body[field]) and body[field] > _MAX_SIM_TOKENS:
            body[field] = _MAX_SIM_TOKENS
    if not bounds:
        body[_COMPLETIONS[case.path]] = _MAX_SIM_TOKENS
    if _is_int(body.get("n")) and body["n"] > _MAX_CHOICES:
        body["n"] = _MAX_CHOICES
    return True


# Request fields that are an engine capability of the same name.
_CAPABILITY_FIELDS = frozenset(get_args(Capability))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(case: schemathesis.Case) -> bool:
    """Whether the case is valid as it is now (reading `meta` revalidates an edited case)."""
    return case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE


def _within_what_no_schema_says(body: dict[str, Any], *, chat: bool) -> None:
    """Keep a valid completion body within what the API refuses by design and no JSON Schema can
    say, each documented in docs/api-compatibility.md: `n` within the deployment's
    AXON_MAX_CHOICES, a schema in a schema slot a valid JSON Schema (not any object), a named
    `tool_choice` naming one of `tools`, whose names are distinct. (`chat`: chat's tools are
    `{type, function: {name...}}`; the Responses' are flat.)"""
    if _is_int(body.get("n")) and body["n"] > _MAX_CHOICES:
        body["n"] = _MAX_CHOICES
    names: list[str] = []
    for index, tool in enumerate(body.get("tools") or []):
        function = tool["function"] if chat else tool
        function["name"] = f"{function['name']}_{index}"[-64:]
        names.append(function["name"])
        if function.get("parameters") is not None:
            function["parameters"] = _A_SCHEMA
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and names:
        (choice["function"] if chat else choice)["name"] = names[0]
    response_format = body.get("response_format") or {}
    if isinstance(response_format.get("json_schema"), dict):
        response_format["json_schema"]["schema"] = _A_SCHEMA
    text_format = (body.get("text") or {}).get("format") or {}
    if text_format.get("schema") is not None:
        text_format["schema"] = _A_SCHEMA


_A_SCHEMA = {"type": "object"}


def _messages_within_what_no_schema_says(body: dict[str, Any]) -> None:
    """Keep a valid Messages body within what the API refuses by design and no JSON Schema can say,
    each documented in docs/api-compatibility.md (Messages): the last message the user's (no
    prefill), tools of distinct names whose `input_schema` is a valid JSON Schema, a `tool` choice
    naming one of them."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        if messages[-1].get("role") != "user":
            messages.append({"role": "user", "content": "Go on."})
    names: list[str] = []
    for index, tool in enumerate(body.get("tools") or []):
        tool["name"] = f"{tool['name']}_{index}"[-64:]
        tool["input_schema"] = {"type": "object"}
        names.append(tool["name"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "tool" and names:
        choice["name"] = names[0]


def _integers_as_integers(value: Any) -> Any:
    """`value` with each number of zero fraction an integer: JSON Schema's `integer` admits `2.0`,
    the API reads JSON integers (docs/api-compatibility.md)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        return {k: _integers_as_integers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integers_as_integers(v) for v in value]
    return value


def _assert_error(response: requests.Response, path: str) -> None:
    """An error in the route's shape: Anthropic's on its Messages routes, else OpenAI's."""
    if path.startswith(_ANTHROPIC):
        _assert_anthropic_error(response)
    else:
        _assert_openai_error(response)


def _assert_anthropic_error(response: requests.Response | httpx.Response) -> None:
    try:
        body = response.json()
    except ValueError:
        pytest.fail(f"{response.status_code} without a JSON body: {response.text[:200]!r}")
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"type", "message"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert error["type"] in _ANTHROPIC_TYPES, body


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


_WITH_KEY_CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    ignored_auth,
    positive_data_acceptance,
    negative_data_rejection,
]
# An upload's validity is not judged here: schemathesis judges a multipart body again as JSON,
# where its binary `file` is not the schema's string, so it calls valid uploads invalid. What an
# upload may be is tested in test_files.py, each refusal by name.
_UPLOAD_CHECKS = _WITH_KEY_CHECKS[:4]


def test_fuzz_with_key(
    gateway_schema: schemathesis.BaseSchema, gateway: Service, fuzz_key: str, sim_capabilities: frozenset[str]
) -> None:
    headers = {"Authorization": f"Bearer {fuzz_key}"}
    statuses: Counter[int] = Counter()

    def check(case: schemathesis.Case) -> None:
        # Always the valid key (schemathesis may generate an Authorization of its own);
        # `ignored_auth` below re-sends each case with no key and with a wrong one.
        case.headers = {**(case.headers or {}), **headers}
        _prepare(case, sim_capabilities)
        response = _call(case, gateway, headers)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (
            f"{response.status_code} {response.text[:500]}\n{case.as_curl_command(headers)}"
        )
        if response.status_code >= 400:
            _assert_error(response, case.path)
        case.validate_response(
            response,
            checks=_WITH_KEY_CHECKS if case.media_type != "multipart/form-data" else _UPLOAD_CHECKS,
            headers=headers,
            transport_kwargs={"base_url": gateway.url, "timeout": TIMEOUT_S},
        )

    fuzz(gateway_schema, check, max_examples=MAX_EXAMPLES)
    _report("fuzz with a key", statuses)


def test_methods_a_path_does_not_have_are_405_listing_the_ones_it_has(
    gateway_schema: schemathesis.BaseSchema, gateway: Service, fuzz_key: str
) -> None:
    """Schemathesis' coverage phase sends each path every method its operations do not declare
    (OPTIONS included): each must be a 405 in OpenAI's shape whose `Allow` lists exactly the
    path's methods."""
    headers = {"Authorization": f"Bearer {fuzz_key}"}
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    for operation in sorted((result.ok() for result in gateway_schema.get_all_operations()), key=lambda op: op.label):
        config = gateway_schema.config.generation_for(operation=operation)
        for case in gateway_schema.iter_coverage_cases(
            operation, generation_modes=[GenerationMode.NEGATIVE], generation_config=config
        ):
            data = case.meta.phase.data if case.meta is not None else None
            if getattr(data, "scenario", None) != CoverageScenario.UNSPECIFIED_HTTP_METHOD:
                continue
            case.headers = {**(case.headers or {}), **headers}
            response = _call(case, gateway, headers)
            statuses[response.status_code] += 1
            try:
                assert response.status_code == 405, response.text
                _assert_error(response, operation.path)
                declared = {method.upper() for method in gateway_schema.raw_schema["paths"][operation.path]}
                allow = ", ".join(response.headers["allow"])  # schemathesis' headers: lists of values
                assert {method.strip() for method in allow.split(",")} == declared, allow
                case.validate_response(response, checks=[unsupported_method, allow_header_conformance], headers=headers)
            except Exception as exc:  # noqa: BLE001 - collected, reported below
                failures.append(f"{case.method} {operation.path}: {type(exc).__name__}: {exc}")
    assert statuses[405] >= 100, statuses
    assert not failures, "\n\n".join(failures)
    _report("methods a path does not have", statuses)


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/embeddings"), ("GET", "/v1/nope"), ("GET", "/nope")])
def test_an_unknown_path_is_openais_invalid_url(fuzz_api: httpx.Client, method: str, path: str) -> None:
    response = fuzz_api.request(method, path)
    assert response.status_code == 404, response.text
    assert response.json() == {
        "error": {
            "message": f"Invalid URL ({method} {path})",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


def test_the_session_manager_answers_an_unknown_path_and_a_wrong_method_alike(sessions: Service) -> None:
    """Its error handlers are the gateway's (shared/http_errors.py)."""
    with httpx.Client(base_url=sessions.url, headers=INTERNAL_AUTH, timeout=TIMEOUT_S) as manager:
        unknown = manager.post("/v1/embeddings")
        assert unknown.status_code == 404, unknown.text
        assert unknown.json()["error"]["message"] == "Invalid URL (POST /v1/embeddings)"
        wrong = manager.put("/v1/sessions/a")
        assert wrong.status_code == 405, wrong.text
        assert wrong.headers["allow"] == "DELETE, GET, PATCH"


def test_fuzz_without_key_is_always_401(gateway_schema: schemathesis.BaseSchema, gateway: Service) -> None:
    statuses: Counter[int] = Counter()

    def check(case: schemathesis.Case) -> None:
        for headers in ({}, {"Authorization": "Bearer axk_not-a-real-key-000000000000000000000000"}):
            response = _call(case, gateway, headers)
            statuses[response.status_code] += 1
            assert response.status_code == 401, (
                f"{response.status_code} {response.text[:500]}\n{case.as_curl_command()}"
            )
            _assert_error(response, case.path)
            assert response.json()["error"]["type"] == "authentication_error"

    # Few cases: test_fuzz_with_key's `ignored_auth` check sends each of its cases again without
    # the key and with a wrong one; here every path and method is tried with bodies of its own.
    fuzz(gateway_schema, check, max_examples=5)
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
    deadline = time.monotonic() + 30  # write-behind: quick, but not on a loaded machine
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
