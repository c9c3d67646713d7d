"""OpenAI's Batch API through the official `openai` client, on the shared stack: a batch's file
uploaded, validated, its lines run on the sim worker and their answers in its output file exactly
once; a bad file fails at validation with its lines named; a line the key may not run is a 4xx
in the error file while the others complete, a line naming no served model a 404 at once, one of
a served model with no live worker waiting for one; cancel;
tenancy; list paging; two deployments sharing one database, each running only its own batches."""

import asyncio
import datetime as dt
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import orjson
import pytest
import redis
from openai import NotFoundError, OpenAI
from openai.types import Batch

from services.cli.launcher import Service
from shared.keys import KeyLimits, hash_key
from shared.names import Names
from shared.ratelimit import budget_window
from shared.tokens import estimate_tokens
from tests.conftest import create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import ADMIN_TOKEN, INTERNAL_AUTH, Stack
from tests.e2e.test_workers import client_for, holder, metric, sim_worker, wait_listed

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"


def _line(custom_id: str, *, model: str = SIM_MODEL, max_tokens: int = 4, url: str = CHAT) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": f"say {custom_id}"}], "max_tokens": max_tokens}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _jsonl(lines: list[dict[str, Any] | bytes]) -> bytes:
    return b"".join((raw if isinstance(raw, bytes) else orjson.dumps(raw)) + b"\n" for raw in lines)


def upload(client: OpenAI, content: bytes) -> str:
    return client.files.create(file=("batch.jsonl", content), purpose="batch").id


def content_lines(client: OpenAI, file_id: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in client.files.content(file_id).content.splitlines() if line]


def _create(client: OpenAI, lines: list[dict[str, Any]]) -> Batch:
    return client.batches.create(input_file_id=upload(client, _jsonl(lines)), endpoint=CHAT, completion_window="24h")


def wait_status(client: OpenAI, batch_id: str, statuses: set[str], *, timeout_s: float = 90) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} after {timeout_s} s"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def limited(gateway: Service, database_url: str) -> OpenAI:
    """A key of its own tenant that may use only the sim model."""
    limits = KeyLimits()
    key = asyncio.run(create_key(database_url, name="batches-limited", limits=limits, tenant="batches-limited"))
    asyncio.run(_allow(database_url, key, [SIM_MODEL]))
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


async def _allow(database_url: str, key: str, models: list[str]) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("UPDATE api_keys SET allowed_models = $2 WHERE key_hash = $1", hash_key(key), models)
    finally:
        await conn.close()


def test_batch_runs_every_line_once(client: OpenAI, sessions: Service, database_url: str) -> None:
    ids = [f"req-{i}" for i in range(12)]
    file_id = upload(client, _jsonl([_line(i) for i in ids]))
    batch = client.batches.create(
        input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"job": "nightly"}
    )
    assert batch.status == "validating"
    assert batch.metadata == {"job": "nightly"}
    done = wait_status(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.error_file_id is None
    assert done.output_file_id is not None
    output = content_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(ids)
    for line in output:
        assert line["error"] is None
        assert line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "chat.completion"
        assert body["model"] == SIM_MODEL
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 4
    assert metric(sessions, "axon_sessions_batch_lines_total", model=SIM_MODEL, outcome="completed") >= 12
    # Its usage rows are marked batch (written behind: within a few seconds).
    assert asyncio.run(_batch_usage_rows(database_url, "tests", at_least=12)) >= 12
    # Its lines (request bodies and answers) are deleted once it ended: its files hold the answers.
    assert asyncio.run(_lines_left(database_url, batch.id)) == 0


async def _batch_usage_rows(database_url: str, tenant: str, *, at_least: int) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        deadline = time.monotonic() + 30
        while True:
            rows = await conn.fetchval(
                "SELECT count(*) FROM usage WHERE batch AND tenant = $1 AND completion_tokens = 4", tenant
            )
            if rows >= at_least or time.monotonic() > deadline:
                return int(rows)
            await asyncio.sleep(0.2)
    finally:
        await conn.close()


async def _lines_left(database_url: str, batch_id: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        deadline = time.monotonic() + 10
        while True:
            left = int(await conn.fetchval("SELECT count(*) FROM batch_lines WHERE batch_id = $1", batch_id))
            if left == 0 or time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.2)
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (b"{not json", "invalid_json_line"),
        (orjson.dumps(_line("req-0")), "duplicate_custom_id"),
        (orjson.dumps(_line("req-x", url="/v1/completions")), "invalid_url"),
        (orjson.dumps({**_line("req-y"), "method": "GET"}), "invalid_method"),
        # PostgreSQL's text cannot hold U+0000, nor orjson write back a body nested 300 deep: such
        # lines once left their batch `validating` for ever.
        (orjson.dumps(_line("req\x00z")), "invalid_custom_id"),
        (orjson.dumps(_line("req-z", model="sim\x00model")), "invalid_model"),
        (
            orjson.dumps(_line("req-deep"))[:-2] + b', "deep": ' + b"[" * 300 + b"]" * 300 + b"}}",
            "invalid_body",
        ),
    ],
)
def test_a_bad_file_fails_at_validation_naming_its_line(client: OpenAI, bad: bytes, code: str) -> None:
    file_id = upload(client, _jsonl([_line("req-0"), _line("req-1"), bad, _line("req-3")]))
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    failed = wait_status(client, batch.id, {"failed", "in_progress", "completed"})
    assert failed.status == "failed"
    assert failed.failed_at is not None
    assert failed.errors is not None and failed.errors.data
    assert [(e.code, e.line) for e in failed.errors.data] == [(code, 3)]
    assert failed.output_file_id is None


def test_a_line_naming_no_served_model_is_404_at_once_and_the_batch_completes(
    client: OpenAI, sessions: Service
) -> None:
    """Each line naming a model that does not exist gets, in the error file at once, what the same
    request gets online (404 `model_not_found`; 400 for a name longer than a model's may be); no
    metric label takes the client's string."""
    unknown = ["m" * 300, "no-such-model!", "café"]
    online = {}
    for model in unknown:
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(**_line("online", model=model)["body"])
        online[model] = (refused.value.status_code, refused.value.body["code"])  # type: ignore[index]
    assert online["no-such-model!"] == online["café"] == (404, "model_not_found")
    lines = [_line("ok"), *(_line(f"unknown-{i}", model=model) for i, model in enumerate(unknown))]
    started = time.monotonic()
    batch = _create(client, lines)
    done = wait_status(client, batch.id, {"completed", "failed", "expired"}, timeout_s=20)
    assert done.status == "completed" and time.monotonic() - started < 20
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 3)
    assert done.error_file_id is not None
    errors = {line["custom_id"]: line["response"] for line in content_lines(client, done.error_file_id)}
    for i, model in enumerate(unknown):
        response = errors[f"unknown-{i}"]
        assert (response["status_code"], response["body"]["error"]["code"]) == online[model]
    text = httpx.get(f"{sessions.url}/metrics", headers=INTERNAL_AUTH, timeout=10).text
    labelled = [line for line in text.splitlines() if line.startswith("axon_sessions_batch_lines_total{")]
    assert labelled and not any(f'model="{model}"' in line for line in labelled for model in unknown)
    assert metric(sessions, "axon_sessions_batch_lines_total", model="unknown", outcome="failed") >= 3


def test_two_deployments_sharing_a_database_each_run_their_own_batches(
    stack: Stack, api_key: str, log_dir: Path
) -> None:
    """A second deployment (its own namespace and model, the same PostgreSQL, Redis and broker)
    started while the first runs a batch: each batch has every line answered once, none failed by
    the other deployment (which once leased every unfinished batch and failed the lines of models
    it did not serve)."""
    model_a, model_b = "isolation-a-sim", "isolation-b-sim"
    sim_worker(stack, "isolation-a", model_a, AXON_SIM_ITL_MS="300")
    first = client_for(stack.start("gateway:isolation-a", env={"AXON_SESSIONS_URL": _sessions_of(stack).url}), api_key)
    wait_listed(first, model_a)
    batch_a = _create(first, [_line(f"a-{i}", model=model_a, max_tokens=16) for i in range(4)])
    wait_status(first, batch_a.id, {"in_progress"})
    other = Stack(
        namespace=f"{stack.namespace}-other",
        database_url=stack.database_url,
        redis_url=stack.redis_url,
        amqp_url=stack.amqp_url,
        log_dir=log_dir,
    )
    try:
        sim_worker(other, "isolation-b", model_b, AXON_SIM_ITL_MS="5")
        second = client_for(other.start("gateway", env={"AXON_SESSIONS_URL": other.start("sessions").url}), api_key)
        wait_listed(second, model_b)
        batch_b = _create(second, [_line(f"b-{i}", model=model_b) for i in range(4)])
        for client, batch, prefix in ((first, batch_a, "a"), (second, batch_b, "b")):
            done = wait_status(client, batch.id, {"completed", "failed", "expired", "cancelled"})
            assert done.request_counts is not None
            counts = (done.status, done.request_counts.completed, done.request_counts.failed)
            assert counts == ("completed", 4, 0), done
            assert done.output_file_id is not None and done.error_file_id is None
            output = content_lines(client, done.output_file_id)
            assert sorted(line["custom_id"] for line in output) == [f"{prefix}-{i}" for i in range(4)]
        # Neither deployment sees the other's batch.
        with pytest.raises(NotFoundError):
            second.batches.retrieve(batch_a.id)
        with pytest.raises(NotFoundError):
            first.batches.retrieve(batch_b.id)
    finally:
        other.close()


def test_a_line_of_a_served_model_with_no_live_worker_waits_for_one(stack: Stack, client: OpenAI, api_key: str) -> None:
    """A model the deployment serves, its only worker gone: its lines wait (never fail for that)
    and are answered once a worker of it is back."""
    model = "isolation-waiting-sim"
    gone = sim_worker(stack, "isolation-waiting", model)
    wait_listed(client, model)
    gone.kill()
    deadline = time.monotonic() + 30
    while model in [m.id for m in client.models.list().data]:
        assert time.monotonic() < deadline, f"{model} still listed"
        time.sleep(0.2)
    batch = _create(client, [_line(f"w-{i}", model=model) for i in range(2)])
    wait_status(client, batch.id, {"in_progress"})
    # For 3 s (a refusal for want of a worker, 503, comes at once), no line ends.
    watched_until = time.monotonic() + 3
    while time.monotonic() < watched_until:
        waiting = client.batches.retrieve(batch.id)
        assert waiting.status == "in_progress" and waiting.request_counts is not None
        assert (waiting.request_counts.completed, waiting.request_counts.failed) == (0, 0)
        time.sleep(0.3)
    sim_worker(stack, "isolation-back", model)
    done = wait_status(client, batch.id, {"completed", "failed", "expired"})
    assert done.request_counts is not None
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 0)


def _sessions_of(stack: Stack) -> Service:
    return next(s for s in stack.services if s.name == "sessions")


def test_bad_batch_requests_are_clear_errors(client: OpenAI, limited: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(input_file_id="file-x", endpoint=CHAT, completion_window="48h")  # type: ignore[arg-type]
    assert window.value.body["param"] == "completion_window"  # type: ignore[index]
    with pytest.raises(NotFoundError):
        client.batches.create(input_file_id="file-unknown", endpoint=CHAT, completion_window="24h")
    file_id = upload(client, _jsonl([_line("a")]))
    with pytest.raises(NotFoundError):  # another tenant's file
        limited.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    empty = upload(client, b"\n\n")
    batch = client.batches.create(input_file_id=empty, endpoint=CHAT, completion_window="24h")
    failed = wait_status(client, batch.id, {"failed", "completed"})
    assert failed.errors is not None
    assert [e.code for e in failed.errors.data] == ["empty_file"]


def test_a_refused_line_is_in_the_error_file_and_the_others_complete(limited: OpenAI) -> None:
    lines = [_line("ok-1"), _line("denied", model="another-model"), _line("ok-2"), _line("bad", max_tokens=0)]
    file_id = upload(limited, _jsonl(lines))
    batch = limited.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    done = wait_status(limited, batch.id, {"completed", "failed"})
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert done.output_file_id and done.error_file_id
    assert sorted(line["custom_id"] for line in content_lines(limited, done.output_file_id)) == ["ok-1", "ok-2"]
    errors = {line["custom_id"]: line["response"] for line in content_lines(limited, done.error_file_id)}
    assert errors["denied"]["status_code"] == 403
    assert errors["denied"]["body"]["error"]["code"] == "model_not_allowed"
    assert errors["bad"]["status_code"] == 400
    assert errors["bad"]["body"]["error"]["param"] == "max_tokens"


def test_cancel_stops_the_batch_with_partial_output(client: OpenAI, sessions: Service) -> None:
    # Long answers (the sim worker's 5 ms per token): the batch is still running when cancelled.
    lines = [_line(f"long-{i}", max_tokens=2000) for i in range(40)]
    file_id = upload(client, _jsonl(lines))
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    wait_status(client, batch.id, {"in_progress"})
    assert metric(sessions, "axon_sessions_batch_lines_waiting", model=SIM_MODEL) > 0
    assert metric(sessions, "axon_sessions_batch_oldest_waiting_seconds", model=SIM_MODEL) >= 0
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in {"cancelling", "cancelled"}
    cancelled = wait_status(client, batch.id, {"cancelled"})
    assert cancelled.cancelled_at is not None
    counts = cancelled.request_counts
    assert counts is not None and counts.total == 40
    assert counts.completed < 40
    assert counts.completed + counts.failed == 40
    assert cancelled.error_file_id is not None
    errors = content_lines(client, cancelled.error_file_id)
    assert len(errors) == counts.failed
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    done = content_lines(client, cancelled.output_file_id) if cancelled.output_file_id else []
    assert len({line["custom_id"] for line in done + errors}) == 40
    with pytest.raises(Exception) as finished:
        client.batches.cancel(wait_status(client, _finished_batch(client), {"completed"}).id)
    assert getattr(finished.value, "status_code", None) == 400


def _finished_batch(client: OpenAI) -> str:
    file_id = upload(client, _jsonl([_line("one")]))
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id


def test_another_tenant_gets_404_and_lists_page(client: OpenAI, limited: OpenAI) -> None:
    created = [_finished_batch(client) for _ in range(3)]
    with pytest.raises(NotFoundError):
        limited.batches.retrieve(created[0])
    with pytest.raises(NotFoundError):
        limited.batches.cancel(created[0])
    assert created[0] not in [b.id for b in limited.batches.list(limit=100)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == created[::-1][:2]
    assert first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == created[0]
    with pytest.raises(NotFoundError):
        client.batches.retrieve("batch_unknown")


def test_owner_and_worker_killed_mid_batch_every_line_once(stack: Stack, gateway: Service, api_key: str) -> None:
    """kill -9 of a worker mid-line (its jobs fail over to the other) and then of the batch's owner
    (another session manager takes the batch over once its lease expires): the batch completes
    with every line answered exactly once, each with the answer the same request gets online."""
    model = "takeover-batch-sim"
    workers = [sim_worker(stack, f"batch-takeover-{i}", model, AXON_SIM_ITL_MS="25") for i in range(2)]
    owner = stack.start("sessions:batch-owner", env={"AXON_RESPONSE_LEASE_S": "2", "AXON_BATCH_LINES_IN_FLIGHT": "4"})
    owner_gateway = stack.start("gateway:batch-owner", env={"AXON_SESSIONS_URL": owner.url})
    client, survivor = client_for(owner_gateway, api_key), client_for(gateway, api_key)
    wait_listed(client, model)
    lines = [_line(f"t-{i}", model=model, max_tokens=24) for i in range(16)]
    batch = client.batches.create(input_file_id=upload(client, _jsonl(lines)), endpoint=CHAT, completion_window="24h")
    wait_status(client, batch.id, {"in_progress"})
    holder(workers, model).kill()
    deadline = time.monotonic() + 60
    while (counts := client.batches.retrieve(batch.id).request_counts) is None or counts.completed < 6:
        assert time.monotonic() < deadline, counts
        time.sleep(0.1)
    owner.kill()
    done = wait_status(survivor, batch.id, {"completed", "failed", "expired"}, timeout_s=120)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (16, 16, 0)
    assert done.output_file_id is not None and done.error_file_id is None
    output = content_lines(survivor, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"t-{i}" for i in range(16))
    for line in output:
        request = next(raw for raw in lines if raw["custom_id"] == line["custom_id"])["body"]
        online = survivor.chat.completions.create(**request)
        assert line["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content
    assert any('"event":"batch_taken_over"' in text and batch.id in text for text in _sessions_logs(stack, owner))


def test_an_interactive_request_takes_a_batch_lines_sequence(stack: Stack, gateway: Service, api_key: str) -> None:
    """A worker of two sequences, both running batch lines (3 s answers, no other line to start
    when one ends): an interactive request starts at once, in the sequence of a line that is
    stopped and handed back, and every line's answer is still the one the same request gets online
    (resumed from its published tokens)."""
    model = "preempt-batch-sim"
    worker = sim_worker(
        stack,
        "preempt",
        model,
        AXON_SIM_MAX_SEQS="2",
        AXON_BATCH_RESERVED_SEQS="0",
        AXON_SIM_TTFT_MS="20",
        AXON_SIM_ITL_MS="50",
    )
    client = client_for(gateway, api_key)
    wait_listed(client, model)
    lines = [_line(f"p-{i}", model=model, max_tokens=60) for i in range(2)]
    batch = client.batches.create(input_file_id=upload(client, _jsonl(lines)), endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 30
    while metric(worker, "axon_worker_batch_sequences", model=model) < 2:
        assert time.monotonic() < deadline, "the worker never ran two batch lines"
        time.sleep(0.05)
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "now"}], max_tokens=4, stream=True
    )
    chunks = iter(stream)
    pieces = [next(chunks)]
    waited = time.monotonic() - started
    assert waited < 1.0, f"the interactive request waited {waited:.2f} s for a sequence"
    pieces += list(chunks)
    assert pieces[-1].choices[0].finish_reason == "length"
    assert metric(worker, "axon_worker_jobs_total", model=model, outcome="preempted") >= 1
    done = wait_status(client, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.output_file_id is not None
    output = content_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == [f"p-{i}" for i in range(2)]
    for line in output:
        request = next(raw for raw in lines if raw["custom_id"] == line["custom_id"])["body"]
        online = client.chat.completions.create(**request)
        assert line["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content
        assert line["response"]["body"]["usage"]["completion_tokens"] == 60
    worker.stop()


def test_a_reserved_sequence_is_kept_free_of_batch_lines(stack: Stack, gateway: Service, api_key: str) -> None:
    """AXON_BATCH_RESERVED_SEQS (1 by default): a worker of two sequences runs one batch line at a
    time, and an interactive request takes the other without preempting it."""
    model = "reserve-batch-sim"
    worker = sim_worker(stack, "reserve", model, AXON_SIM_MAX_SEQS="2", AXON_SIM_ITL_MS="50")
    client = client_for(gateway, api_key)
    wait_listed(client, model)
    lines = [_line(f"r-{i}", model=model, max_tokens=30) for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, _jsonl(lines)), endpoint=CHAT, completion_window="24h")
    running = []
    while (current := client.batches.retrieve(batch.id)).status not in {"completed", "failed"}:
        running.append(metric(worker, "axon_worker_batch_sequences", model=model))
        if len(running) == 10:
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "now"}], max_tokens=4
            )
            assert answer.choices[0].finish_reason == "length"
        time.sleep(0.2)
    assert current.status == "completed"
    assert max(running) == 1, running
    assert metric(worker, "axon_worker_jobs_total", model=model, outcome="preempted") == 0
    worker.stop()


def _sessions_logs(stack: Stack, dead: Service) -> list[str]:
    return [s.log_text() for s in stack.services if s.name.split(":")[0] == "sessions" and s is not dead]


def test_cli_lists_shows_and_cancels_batches(stack: Stack, client: OpenAI) -> None:
    # 40 s answers (the sim worker's 5 ms per token): every line may run at once, and the three
    # commands take a few seconds; the batch must still be running at the cancel.
    lines = [_line(f"cli-{i}", max_tokens=8000) for i in range(40)]
    batch = client.batches.create(input_file_id=upload(client, _jsonl(lines)), endpoint=CHAT, completion_window="24h")
    wait_status(client, batch.id, {"in_progress"})

    def axon(*args: str) -> str:
        command = [sys.executable, "-m", "services.cli.main", "batches", *args]
        return subprocess.run(command, env=stack.env({}), capture_output=True, text=True, timeout=60, check=True).stdout

    assert batch.id in axon("list", "--tenant", "tests")
    shown = orjson.loads(axon("show", batch.id))
    assert (shown["id"], shown["tenant"], shown["request_counts"]["total"]) == (batch.id, "tests", 40)
    assert axon("cancel", batch.id).split() == [batch.id, "cancelling"]
    cancelled = wait_status(client, batch.id, {"cancelled"})
    assert cancelled.request_counts is not None and cancelled.request_counts.completed < 40


def test_a_keys_batch_queue_limit_fails_a_batch_past_it_and_refuses_new_ones_while_full(
    stack: Stack, api_key: str
) -> None:
    long = [_line(f"q-{i}", max_tokens=2000) for i in range(2)]
    # What each line counts (its body's characters / 4, and max_tokens): the limit is exactly two.
    limit = sum(estimate_tokens(chars=len(orjson.dumps(line["body"]))) + 2000 for line in long)
    sessions = stack.start("sessions:batch-queue", env={"AXON_BATCH_QUEUE_TOKENS": str(limit)})
    client = client_for(stack.start("gateway:batch-queue", env={"AXON_SESSIONS_URL": sessions.url}), api_key)

    three = [*long, _line("q-2", max_tokens=2000)]
    over = _create(client, three)
    failed = wait_status(client, over.id, {"failed", "in_progress"})
    assert failed.status == "failed" and failed.errors is not None
    assert [e.code for e in failed.errors.data] == ["token_limit_exceeded"]

    full = _create(client, long)
    wait_status(client, full.id, {"in_progress"})
    with pytest.raises(openai.RateLimitError) as refused:
        client.batches.create(
            input_file_id=upload(client, _jsonl([_line("q-3")])), endpoint=CHAT, completion_window="24h"
        )
    assert refused.value.code == "token_limit_exceeded"
    client.batches.cancel(full.id)
    wait_status(client, full.id, {"cancelled"})
    after = client.batches.create(
        input_file_id=upload(client, _jsonl([_line("q-4")])), endpoint=CHAT, completion_window="24h"
    )
    assert wait_status(client, after.id, {"completed", "failed"}).status == "completed"


@pytest.mark.parametrize(
    ("endpoint", "body", "obj"),
    [
        ("/v1/completions", {"model": SIM_MODEL, "prompt": "Once", "max_tokens": 3}, "text_completion"),
        ("/v1/responses", {"model": SIM_MODEL, "input": "Once", "max_output_tokens": 3, "store": False}, "response"),
    ],
)
def test_completions_and_responses_lines(client: OpenAI, endpoint: str, body: dict[str, Any], obj: str) -> None:
    lines = [{"custom_id": f"e-{i}", "method": "POST", "url": endpoint, "body": body} for i in range(3)]
    lines.append({"custom_id": "streamed", "method": "POST", "url": endpoint, "body": {**body, "stream": True}})
    file_id = upload(client, _jsonl(lines))
    batch = client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    done = wait_status(client, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.output_file_id and done.error_file_id
    output = content_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == ["e-0", "e-1", "e-2"]
    assert {line["response"]["body"]["object"] for line in output} == {obj}
    [refused] = content_lines(client, done.error_file_id)
    assert (refused["custom_id"], refused["response"]["status_code"]) == ("streamed", 400)


def test_past_its_window_a_batch_expires_keeping_what_finished(client: OpenAI, database_url: str) -> None:
    lines = [_line("short-0"), *(_line(f"slow-{i}", max_tokens=2000) for i in range(40))]
    batch = _create(client, lines)
    deadline = time.monotonic() + 60
    while (counts := client.batches.retrieve(batch.id).request_counts) is None or counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    asyncio.run(_expire_now(database_url, batch.id))  # its 24 h window, passed
    expired = wait_status(client, batch.id, {"expired"})
    assert expired.expired_at is not None and expired.request_counts is not None
    assert expired.request_counts.completed >= 1
    assert expired.request_counts.completed + expired.request_counts.failed == 41
    assert expired.output_file_id and expired.error_file_id
    finished = content_lines(client, expired.output_file_id)
    assert "short-0" in {line["custom_id"] for line in finished}
    errors = content_lines(client, expired.error_file_id)
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}
    assert len({line["custom_id"] for line in finished + errors}) == 41


async def _expire_now(database_url: str, batch_id: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("UPDATE batches SET expires_at = now() WHERE id = $1", batch_id)
    finally:
        await conn.close()


def test_batch_tokens_are_billed_at_the_billing_factor(stack: Stack, database_url: str) -> None:
    """AXON_BATCH_BILLING_FACTOR 0.5: each line's tokens count half of them (rounded up) against its
    key's budget, and /admin/usage reports the raw tokens beside the billed ones."""
    factor = {"AXON_BATCH_BILLING_FACTOR": "0.5"}
    sessions = stack.start("sessions:billing", env=factor)
    gateway = stack.start("gateway:billing", env={"AXON_SESSIONS_URL": sessions.url, **factor})
    limits = KeyLimits(token_budget=1_000_000, budget_period="day")
    key = asyncio.run(create_key(database_url, name="batches-billed", limits=limits, tenant="batches-billed"))
    client = client_for(gateway, key)
    done = wait_status(client, _create(client, [_line(f"b-{i}", max_tokens=5) for i in range(5)]).id, {"completed"})
    assert done.output_file_id is not None
    used = [line["response"]["body"]["usage"]["total_tokens"] for line in content_lines(client, done.output_file_id)]
    assert len(used) == 5

    key_id = asyncio.run(_key_id(database_url, key))
    period = budget_window("day", dt.datetime.now(dt.UTC))[0]
    budget = Names(stack.namespace).rate_limit("budget", f"{key_id}:{period}")
    client_redis = redis.Redis.from_url(stack.redis_url)
    try:
        # Settled as each line ends: read once every line's settlement is in.
        deadline = time.monotonic() + 10
        while int(client_redis.hget(budget, "used") or 0) != sum(math.ceil(t / 2) for t in used):
            assert time.monotonic() < deadline, (client_redis.hgetall(budget), used)
            time.sleep(0.2)
        assert not [field for field in client_redis.hkeys(budget) if field.startswith(b"r:")]  # none left reserved
    finally:
        client_redis.close()

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    deadline = time.monotonic() + 30
    while True:  # usage rows are written behind
        rows = httpx.get(f"{gateway.url}/admin/usage", params={"key_id": key_id}, headers=admin, timeout=10)
        data = rows.json()["data"]
        if data and data[0]["batch_requests"] == 5:
            break
        assert time.monotonic() < deadline, data
        time.sleep(0.3)
    row = data[0]
    assert row["requests"] == 5 and row["prompt_tokens"] + row["completion_tokens"] == sum(used)
    assert row["batch_prompt_tokens"] + row["batch_completion_tokens"] == sum(used)
    assert row["billed_tokens"] == math.ceil(sum(used) / 2)


async def _key_id(database_url: str, key: str) -> str:
    conn = await asyncpg.connect(database_url)
    try:
        return str(await conn.fetchval("SELECT id FROM api_keys WHERE key_hash = $1", hash_key(key)))
    finally:
        await conn.close()
