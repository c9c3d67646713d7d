"""Nothing in Redis grows without bound: after a run of the simulator stack through every kind of
state it keeps (chats, sessions, conversations, stored and background responses, resumable streams,
a worker killed mid-stream), every key of the namespace expires, or is one of the keys with an
owner that removes what they hold (`Names.keys_without_expiry`, listed in docs/architecture.md)."""

import json
import re
import time

import httpx
import pytest
import redis
from openai import OpenAI

from services.cli.launcher import Service
from shared.names import Names
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import Stack
from tests.e2e.test_workers import holder, sim_worker, wait_listed

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def _traffic(stack: Stack, client: OpenAI, http: httpx.Client) -> None:
    """One of everything that leaves state in Redis."""
    client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=4)
    assert list(client.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=4, stream=True))

    def turn(session_id: str, *, stream: bool) -> httpx.Response:
        body = {"model": SIM_MODEL, "messages": MESSAGES, "session_id": session_id, "max_tokens": 4, "stream": stream}
        answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200
        return answer

    kept = http.post("/v1/sessions", json={"title": "kept"}).json()["id"]
    turn(kept, stream=False)
    # A streamed session turn keeps a chunk log, which the client replays.
    streamed = turn(kept, stream=True)
    completion_id = json.loads(streamed.text.split("data: ", 1)[1].split("\n", 1)[0])["id"]
    assert http.get(f"/v1/chat/completions/{completion_id}/stream").status_code == 200
    deleted = http.post("/v1/sessions", json={}).json()["id"]
    turn(deleted, stream=False)
    assert http.delete(f"/v1/sessions/{deleted}").status_code == 200

    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}])
    client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}]
    )
    client.conversations.items.delete("msg_1", conversation_id=conversation.id)

    first = client.responses.create(model=SIM_MODEL, input="Hi", max_output_tokens=4, conversation=conversation.id)
    client.responses.create(model=SIM_MODEL, input="More", max_output_tokens=4, previous_response_id=first.id)
    client.responses.delete(client.responses.create(model=SIM_MODEL, input="x", max_output_tokens=2).id)
    background = client.responses.create(model=SIM_MODEL, input="Later", max_output_tokens=4, background=True)
    deadline = time.monotonic() + 20
    while client.responses.retrieve(background.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never finished"
        time.sleep(0.1)

    # A worker killed mid-stream: another resumes the answer.
    model = "keys-failover"
    workers = [sim_worker(stack, f"keys-{i}", model, AXON_SIM_ITL_MS="20") for i in range(2)]
    wait_listed(client, model)
    pieces, text, killed = [], "", False
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=60, stream=True):
        pieces.append(chunk)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if len(text.split()) >= 10 and not killed:  # the simulator's tokens are words; a chunk may carry several
            holder(workers, model).kill()
            killed = True
    assert killed and pieces[-1].choices[0].finish_reason == "length"


def _shape(key: str, namespace: str) -> str:
    """A key with its namespace and ids left out, to list what kinds of key there are."""
    rest = key.removeprefix(namespace)
    return "<ns>" + re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}|resp_[0-9a-f]+|key_[0-9a-f]+|[0-9a-f]{32,}", "<id>", rest)


def test_every_key_left_after_a_run_expires_or_has_an_owner(
    stack: Stack, gateway: Service, api_key: str, namespace: str
) -> None:
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=30)
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as http:
        _traffic(stack, client, http)
    owned = Names(namespace).keys_without_expiry
    connection = redis.Redis.from_url(stack.redis_url)
    try:
        keys = [k.decode() for k in connection.scan_iter(match=f"{namespace}:*", count=1000)]
        without_expiry = {k for k in keys if connection.ttl(k) == -1}
    finally:
        connection.close()
    kinds = sorted({_shape(k, namespace) for k in keys})
    print(
        f"\nRedis keys after the run: {len(keys)}, {len(without_expiry)} without expiry:"
        f" {sorted(_shape(k, namespace) for k in without_expiry)}; every kind: {kinds}"
    )
    assert len(keys) > len(without_expiry) > 0
    assert sorted(without_expiry - owned) == []
