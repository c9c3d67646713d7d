"""Background responses survive kill -9 of the session manager relaying them (another one takes
the response over once its lease expires, and stores it and appends it to its conversation) and
of the worker generating them (failover), each ending `completed` with the full text; a stored
stream whose client leaves before its first token runs on; a relay that loses its pub/sub
connection follows the job's chunk log to the end instead; and a session manager that stops
hands its responses (and its batches, side by side) over at once.

The answers are JSON (`text.format`), which the simulator ends with `stop` once complete, at one
short piece per 40 ms: long enough to kill a process mid-answer. The full text is that of the
same request answered undisturbed (the simulator's answer depends only on the prompt)."""

from typing import Any

import httpx
import orjson
import pytest
import redis
from openai import OpenAI
from openai.types.responses import Response

from services.cli.launcher import Service
from shared.names import Names
from tests.e2e.stack import Stack, kill_subscribers
from tests.e2e.test_batches import content_lines, upload
from tests.e2e.test_batches import wait_status as wait_batch
from tests.e2e.test_responses import wait_status
from tests.e2e.test_workers import client_for, holder, metric, sim_worker, wait_listed

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "properties": {name: {"type": "string", "minLength": 20} for name in ("title", "summary", "ending")},
    "required": ["title", "summary", "ending"],
}
TEXT = {"format": {"type": "json_schema", "name": "story", "schema": SCHEMA}}


def _ask(client: OpenAI, model: str, prompt: str, **fields: Any) -> Response:
    return client.responses.create(model=model, input=prompt, text=TEXT, **fields)  # type: ignore[arg-type]


def _stored_of(stack: Stack, model: str) -> str:
    """The id of the one stored response of `model` (its client never saw it)."""
    client = redis.Redis.from_url(stack.redis_url)
    try:
        for key in client.scan_iter(match=Names(stack.namespace).response("*"), count=1000):
            if orjson.loads(client.get(key) or b"{}").get("response", {}).get("model") == model:
                return key.decode().rsplit(":", 1)[1]
    finally:
        client.close()
    raise AssertionError(f"no stored response of {model}")


def test_killing_the_relaying_session_manager_another_takes_the_response_over(
    stack: Stack, gateway: Service, sessions: Service, api_key: str
) -> None:
    model = "takeover-sessions-sim"
    sim_worker(stack, "takeover-sessions", model, AXON_SIM_ITL_MS="40")
    victim = stack.start("sessions:takeover", env={"AXON_RESPONSE_LEASE_S": "2"})
    victim_gateway = stack.start("gateway:takeover", env={"AXON_SESSIONS_URL": victim.url})
    client, survivor = client_for(victim_gateway, api_key), client_for(gateway, api_key)
    wait_listed(client, model)
    expected = _ask(survivor, model, "A story, please.", store=False)
    assert expected.status == "completed"

    conversation = client.conversations.create()
    queued = _ask(client, model, "A story, please.", background=True, conversation=conversation.id)
    running = wait_status(client, queued.id, {"in_progress"}, timeout_s=30)
    victim.kill()
    done = wait_status(survivor, queued.id, {"completed", "incomplete", "failed"}, timeout_s=30)
    assert done.status == "completed" and done.output_text == expected.output_text
    assert len(done.output_text) > len(running.output_text)
    items = survivor.conversations.items.list(conversation.id, order="asc").data
    assert [i.role for i in items] == ["user", "assistant"]  # type: ignore[union-attr]
    assert items[1].content[0].text == expected.output_text  # type: ignore[union-attr]
    # Taken over by a surviving session manager: the shared one, or another module's still running
    # in this namespace (every one sweeps its leases).
    others = [s for s in stack.services if s.name.split(":")[0] == "sessions" and s not in (sessions, victim)]
    survivors = [sessions, *(s for s in others if s.process.poll() is None)]
    taken = [
        (s, line)
        for s in survivors
        for line in s.log_text().splitlines()
        if '"event":"response_taken_over"' in line and queued.id in line
    ]
    assert taken
    assert metric(taken[0][0], "axon_sessions_responses_taken_over_total", reason="lease_expired") >= 1
    events = list(survivor.responses.retrieve(queued.id, stream=True))
    assert events[-1].response == done  # type: ignore[union-attr]


def test_killing_the_worker_another_finishes_the_response(stack: Stack, gateway: Service, api_key: str) -> None:
    model = "takeover-workers-sim"
    # 100 ms a piece: the answer lasts about 3 s, long enough to find its worker running it on a
    # loaded machine (at 40 ms it lasted about 1.2 s, and the search once came too late).
    workers = [sim_worker(stack, f"takeover-workers-{i}", model, AXON_SIM_ITL_MS="100") for i in range(2)]
    client = client_for(gateway, api_key)
    wait_listed(client, model)
    expected = _ask(client, model, "Another story.", store=False)

    queued = _ask(client, model, "Another story.", background=True)
    running = wait_status(client, queued.id, {"in_progress"}, timeout_s=30)
    holder(workers, model).kill()
    done = wait_status(client, queued.id, {"completed", "incomplete", "failed"}, timeout_s=30)
    assert done.status == "completed" and done.output_text == expected.output_text
    assert len(done.output_text) > len(running.output_text)
    survivor = next(w for w in workers if w.process.poll() is None)
    assert metric(survivor, "axon_worker_jobs_total", model=model, outcome="resumed") == 1


def test_a_stored_stream_left_before_its_first_token_runs_on(
    stack: Stack, gateway: Service, api_key: str, auth: dict
) -> None:
    model = "slow-start-sim"
    sim_worker(stack, "slow-start", model, AXON_SIM_TTFT_MS="1500", AXON_SIM_ITL_MS="5")
    client = client_for(gateway, api_key)
    wait_listed(client, model)
    body = {"model": model, "input": "Wait for it.", "max_output_tokens": 20, "stream": True}
    with pytest.raises(httpx.ReadTimeout):  # nothing comes before the first token: the client gives up
        httpx.post(f"{gateway.url}/v1/responses", json=body, headers=auth, timeout=0.5)
    done = wait_status(client, _stored_of(stack, model), {"completed", "incomplete", "failed"}, timeout_s=30)
    assert done.status == "incomplete" and done.usage is not None and done.usage.output_tokens == 20


def test_a_relay_that_loses_its_chunks_follows_the_log_to_the_end(stack: Stack, api_key: str, gateway: Service) -> None:
    model = "lost-relay-sim"
    sim_worker(stack, "lost-relay", model, AXON_SIM_ITL_MS="40")
    relaying = stack.start("sessions:lost-relay")
    client = client_for(stack.start("gateway:lost-relay", env={"AXON_SESSIONS_URL": relaying.url}), api_key)
    wait_listed(client, model)
    expected = _ask(client, model, "A lost story.", store=False)
    queued = _ask(client, model, "A lost story.", background=True)
    stream = _ask(client, model, "A lost story.", stream=True)
    seen = [event for _, event in zip(range(8), stream, strict=False)]
    wait_status(client, queued.id, {"in_progress"}, timeout_s=30)
    assert kill_subscribers(stack.redis_url, relaying.pid) >= 1
    seen += list(stream)  # the stream ends where its chunks stopped coming, with no terminal event
    assert seen[-1].type == "response.output_text.delta"
    response_id = seen[0].response.id  # type: ignore[union-attr]
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == expected.output_text and rest[-1].type == "response.completed"
    done = wait_status(client, queued.id, {"completed", "incomplete", "failed"}, timeout_s=30)
    assert done.status == "completed" and done.output_text == expected.output_text
    lost = [line for line in relaying.log_text().splitlines() if '"event":"response_relay_lost"' in line]
    assert {queued.id, response_id} <= {orjson.loads(line)["response_id"] for line in lost}
    assert metric(relaying, "axon_sessions_responses_taken_over_total", reason="stream_lost") == 2
    assert metric(relaying, "axon_sessions_active_streams") == 0  # the relays that gave them up ended theirs


def _lease(client: redis.Redis, running: str, owners: str, answer_id: str) -> tuple[float | None, bytes | None]:
    """`answer_id`'s lease expiry and owner, read together."""
    with client.pipeline(transaction=True) as pipe:
        expiry, owner = pipe.zscore(running, answer_id).hget(owners, answer_id).execute()
    return expiry, owner


def test_a_stopping_session_manager_hands_its_responses_over_at_once(
    stack: Stack, gateway: Service, api_key: str
) -> None:
    """And its batch beside it: stopping the batch's running lines does not hold the response back."""
    model = "handover-sim"
    sim_worker(stack, "handover", model, AXON_SIM_ITL_MS="40")
    # A lease longer than the test: only a handover lets another session manager take over in time.
    stopping = stack.start("sessions:handover", env={"AXON_RESPONSE_LEASE_S": "120"})
    client = client_for(stack.start("gateway:handover", env={"AXON_SESSIONS_URL": stopping.url}), api_key)
    survivor = client_for(gateway, api_key)
    wait_listed(client, model)
    expected = _ask(survivor, model, "Hand it over.", store=False)
    queued = _ask(client, model, "Hand it over.", background=True)
    body = {"model": model, "messages": [{"role": "user", "content": "A long line."}], "max_tokens": 200}
    lines = [{"custom_id": f"h-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(3)]
    batch = client.batches.create(
        input_file_id=upload(client, b"".join(orjson.dumps(line) + b"\n" for line in lines)),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_status(client, queued.id, {"in_progress"}, timeout_s=30)
    wait_batch(client, batch.id, {"in_progress"}, timeout_s=30)
    names = Names(stack.namespace)
    leases = redis.Redis.from_url(stack.redis_url)
    try:
        holder = leases.hget(names.responses_owners, queued.id)
        assert holder is not None and leases.hget(names.batches_owners, batch.id) == holder
        assert stopping.stop(timeout_s=30) == 0
        expiry, owner = _lease(leases, names.responses_running, names.responses_owners, queued.id)
        batch_expiry, batch_owner = _lease(leases, names.batches_running, names.batches_owners, batch.id)
    finally:
        leases.close()
    # Handed over: expired at once, or already claimed by another session manager's sweep (a new
    # owner and expiry) or finished by it (gone). Not handed over, it would still be the holder's.
    assert expiry == 0 or owner != holder
    assert batch_expiry == 0 or batch_owner != holder
    done = wait_status(survivor, queued.id, {"completed", "incomplete", "failed"}, timeout_s=30)
    assert done.status == "completed" and done.output_text == expected.output_text
    assert '"event":"response_leases_not_handed_over"' not in stopping.log_text()
    finished = wait_batch(survivor, batch.id, {"completed", "failed", "cancelled", "expired"}, timeout_s=90)
    assert finished.status == "completed" and finished.output_file_id is not None
    assert sorted(line["custom_id"] for line in content_lines(survivor, finished.output_file_id)) == [
        "h-0",
        "h-1",
        "h-2",
    ]
