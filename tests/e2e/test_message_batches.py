"""Anthropic's Message Batches through the official `anthropic` client, on the shared sim stack:
`client.messages.batches.create/retrieve/list/cancel/results/delete`; a batch's every request
answered exactly once (a bad request's params, an unknown model: `errored` with Anthropic's error,
the others `succeeded`); cancel (`canceled` results, the counts); a batch's shape refused at create
with Anthropic's 400; another tenant's key sees nothing of it; the OpenAI Batch API and this one
never see each other's batches; its owner killed, another session manager finishes it, each
request once."""

import asyncio
import time
from typing import Any

import anthropic
import asyncpg
import httpx
import pytest
from anthropic import Anthropic
from anthropic.types.messages import MessageBatch
from openai import OpenAI

from services.cli.launcher import Service
from shared.keys import KeyLimits
from tests.conftest import create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e


def _request(custom_id: str, **params: Any) -> dict[str, Any]:
    body = {"model": SIM_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"say {custom_id}"}]}
    return {"custom_id": custom_id, "params": {**body, **params}}


def _anthropic(gateway: Service, key: str, **headers: str) -> Anthropic:
    return Anthropic(base_url=gateway.url, api_key=key, max_retries=0, timeout=30, default_headers=headers)


@pytest.fixture(scope="module")
def claude(gateway: Service, api_key: str) -> Anthropic:
    return _anthropic(gateway, api_key)


@pytest.fixture(scope="module")
def other_tenant(gateway: Service, database_url: str) -> Anthropic:
    key = asyncio.run(create_key(database_url, name="msgbatch-other", limits=KeyLimits(), tenant="msgbatch-other"))
    return _anthropic(gateway, key)


def wait_ended(client: Anthropic, batch_id: str, *, timeout_s: float = 90) -> MessageBatch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.processing_status} after {timeout_s} s"
        time.sleep(0.3)


async def _lines_left(database_url: str, batch_id: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM batch_lines WHERE batch_id = $1", batch_id))
    finally:
        await conn.close()


def test_every_request_is_answered_once_and_read_back_with_the_sdk(
    claude: Anthropic, gateway: Service, database_url: str
) -> None:
    ids = [f"req-{i}" for i in range(8)]
    requests = [
        *(_request(i) for i in ids),
        # Its params break the Messages API's rules (checked when it runs): errored, the others run.
        {"custom_id": "no-max-tokens", "params": {"model": SIM_MODEL, "messages": [{"role": "user", "content": "x"}]}},
        _request("unknown-model", model="no-such-model"),
    ]
    created = claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.results_url is None
    assert created.request_counts.processing == 10
    assert (created.expires_at - created.created_at).total_seconds() == 86_400

    ended = wait_ended(claude, created.id)
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 8, 2, 0, 0)
    assert ended.ended_at is not None and ended.ended_at >= ended.created_at
    assert ended.results_url == f"{gateway.url}/v1/messages/batches/{created.id}/results"

    results = list(claude.messages.batches.results(created.id))
    # Each request once.
    assert sorted(r.custom_id for r in results) == sorted([*ids, "no-max-tokens", "unknown-model"])
    by_id = {r.custom_id: r.result for r in results}
    for custom_id in ids:
        result = by_id[custom_id]
        assert result.type == "succeeded"
        message = result.message
        assert message.type == "message" and message.role == "assistant" and message.model == SIM_MODEL
        assert message.content[0].type == "text" and message.content[0].text
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
    refused = by_id["no-max-tokens"]
    assert refused.type == "errored" and refused.error.error.type == "invalid_request_error"
    assert "max_tokens" in refused.error.error.message and refused.error.request_id
    unknown = by_id["unknown-model"]
    assert unknown.type == "errored" and unknown.error.error.type == "not_found_error"
    # The lines are gone once it ended: its results file holds the answers.
    assert asyncio.run(_lines_left(database_url, created.id)) == 0

    # The key in `Authorization: Bearer` works as well as in `x-api-key`.
    bearer = httpx.get(
        f"{gateway.url}/v1/messages/batches/{created.id}",
        headers={"Authorization": f"Bearer {claude.api_key}"},
        timeout=10,
    )
    assert bearer.status_code == 200 and bearer.json()["id"] == created.id


def test_cancel_ends_the_batch_its_unrun_requests_canceled_then_delete(claude: Anthropic) -> None:
    # Long answers (the sim worker's 5 ms per token): most are not run when the cancel comes.
    created = claude.messages.batches.create(
        requests=[_request(f"long-{i}", max_tokens=2000) for i in range(30)]  # type: ignore[misc]
    )
    with pytest.raises(anthropic.BadRequestError) as running:
        claude.messages.batches.delete(created.id)
    assert running.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    canceling = claude.messages.batches.cancel(created.id)
    assert canceling.processing_status in {"canceling", "ended"} and canceling.cancel_initiated_at is not None
    ended = wait_ended(claude, created.id)
    counts = ended.request_counts
    assert counts.canceled > 0 and counts.expired == 0 and counts.processing == 0
    assert counts.succeeded + counts.errored + counts.canceled == 30
    results = list(claude.messages.batches.results(created.id))
    assert len({r.custom_id for r in results}) == len(results) == 30
    assert sum(r.result.type == "canceled" for r in results) == counts.canceled
    assert sum(r.result.type == "succeeded" for r in results) == counts.succeeded

    with pytest.raises(anthropic.BadRequestError):  # it has ended
        claude.messages.batches.cancel(created.id)
    deleted = claude.messages.batches.delete(created.id)
    assert (deleted.id, deleted.type) == (created.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve(created.id)


@pytest.mark.parametrize(
    ("requests", "param"),
    [
        ([], "requests"),
        ([_request("a"), _request("b"), _request("a")], "requests.2.custom_id"),
        ([_request("not ok")], "requests.0.custom_id"),
        ([_request("x" * 65)], "requests.0.custom_id"),
        ([{"custom_id": "a", "params": {"max_tokens": 4}}], "requests.0.params.model"),
        ([{"custom_id": "a", "params": {"model": SIM_MODEL}, "extra": 1}], "requests.0.extra"),
    ],
)
def test_a_batch_of_the_wrong_shape_is_refused_at_create(
    claude: Anthropic, requests: list[dict[str, Any]], param: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and param in body["error"]["message"]
    assert refused.value.response.headers.get("request-id")


def test_another_tenant_and_the_openai_api_see_nothing_of_a_batch(
    claude: Anthropic, other_tenant: Anthropic, client: OpenAI, gateway: Service
) -> None:
    first = claude.messages.batches.create(requests=[_request("mine")])  # type: ignore[list-item]
    second = claude.messages.batches.create(requests=[_request("mine-too")])  # type: ignore[list-item]
    for call in (
        other_tenant.messages.batches.retrieve,
        other_tenant.messages.batches.cancel,
        other_tenant.messages.batches.delete,
    ):
        with pytest.raises(anthropic.NotFoundError) as hidden:
            call(first.id)
        assert hidden.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    results = httpx.get(
        f"{gateway.url}/v1/messages/batches/{first.id}/results", headers={"x-api-key": other_tenant.api_key}
    )
    assert results.status_code == 404 and results.json()["type"] == "error"
    assert not [b for b in other_tenant.messages.batches.list(limit=100).data if b.id in {first.id, second.id}]

    # Paged one at a time, newest first, with `after_id` (the SDK's auto-paging) and `before_id`.
    newest = [b.id for b in claude.messages.batches.list(limit=2).data]
    assert newest == [second.id, first.id]
    paged = [b.id for _, b in zip(range(2), claude.messages.batches.list(limit=1), strict=False)]
    assert paged == [second.id, first.id]
    before = claude.messages.batches.list(limit=1, before_id=first.id)
    assert [b.id for b in before.data] == [second.id] and before.first_id == second.id

    # The OpenAI Batch API does not list or find them, and this one does not find OpenAI's.
    assert not [b for b in client.batches.list(limit=100).data if b.id.startswith("msgbatch_")]
    missing = httpx.get(f"{gateway.url}/v1/batches/{first.id}", headers={"Authorization": f"Bearer {client.api_key}"})
    assert missing.status_code == 404
    wait_ended(claude, first.id)
    wait_ended(claude, second.id)


def test_a_missing_key_is_anthropics_401_and_results_wait_for_the_end(claude: Anthropic, gateway: Service) -> None:
    anonymous = httpx.get(f"{gateway.url}/v1/messages/batches", timeout=10)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    created = claude.messages.batches.create(
        requests=[_request(f"slow-{i}", max_tokens=2000) for i in range(4)]  # type: ignore[misc]
    )
    early = httpx.get(
        f"{gateway.url}/v1/messages/batches/{created.id}/results", headers={"x-api-key": claude.api_key}, timeout=10
    )
    assert early.status_code == 400 and early.json()["error"]["type"] == "invalid_request_error"
    claude.messages.batches.cancel(created.id)
    wait_ended(claude, created.id)


def test_its_owner_killed_another_session_manager_answers_every_request_once(
    stack: Stack, gateway: Service, api_key: str, claude: Anthropic
) -> None:
    """kill -9 of the session manager that owns a message batch: another takes it over once the
    lease expires (the Batch API's machinery) and every request is in the results exactly once."""
    owner = stack.start(
        "sessions:msgbatch-owner", env={"AXON_RESPONSE_LEASE_S": "2", "AXON_BATCH_LINES_IN_FLIGHT": "2"}
    )
    owner_client = _anthropic(stack.start("gateway:msgbatch-owner", env={"AXON_SESSIONS_URL": owner.url}), api_key)
    # 100 tokens at the sim worker's 5 ms each: two at a time, the batch lasts a few seconds.
    ids = [f"t-{i}" for i in range(12)]
    created = owner_client.messages.batches.create(requests=[_request(i, max_tokens=100) for i in ids])  # type: ignore[misc]
    deadline = time.monotonic() + 60
    while owner_client.messages.batches.retrieve(created.id).request_counts.succeeded < 3:
        assert time.monotonic() < deadline, "no request answered"
        time.sleep(0.1)
    owner.kill()
    ended = wait_ended(claude, created.id, timeout_s=120)
    counts = ended.request_counts
    assert (counts.succeeded, counts.errored, counts.canceled, counts.expired) == (12, 0, 0, 0)
    results = list(claude.messages.batches.results(created.id))
    assert sorted(r.custom_id for r in results) == sorted(ids)
    assert all(r.result.type == "succeeded" and r.result.message.usage.output_tokens == 100 for r in results)
    survivors = [s.log_text() for s in stack.services if s.name.split(":")[0] == "sessions" and s is not owner]
    assert any('"event":"batch_taken_over"' in text and created.id in text for text in survivors)
