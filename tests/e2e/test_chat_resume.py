"""Resumable chat streams through real processes: every event has an `id:`, a session turn's client
that drops its stream gets the rest from `GET /v1/chat/completions/{id}/stream` with
`Last-Event-ID`, and the answer its events add up to is the one the session's history stored."""

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from services.cli.launcher import Service
from shared.keys import KeyLimits
from tests.conftest import ServiceUrls, create_key
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import Stack, kill_subscribers

pytestmark = pytest.mark.e2e


class Event:
    """One server-sent event: its id (None without one) and its data."""

    def __init__(self, event_id: str | None, data: str) -> None:
        self.id = event_id
        self.data = data

    @property
    def done(self) -> bool:
        return self.data == "[DONE]"

    @property
    def delta(self) -> str:
        body = json.loads(self.data)
        return "".join(choice["delta"].get("content") or "" for choice in body["choices"])


def events_of(response: httpx.Response | Iterator[str], *, stop_after: int | None = None) -> list[Event]:
    """The events of a response (or of the lines left of one), up to `[DONE]` (or the first `stop_after`)."""
    events: list[Event] = []
    event_id, data = None, []
    for line in response.iter_lines() if isinstance(response, httpx.Response) else response:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif not line and data:
            events.append(Event(event_id, "\n".join(data)))
            event_id, data = None, []
            if events[-1].done or len(events) == stop_after:
                break
    return events


@pytest.fixture(scope="module")
def http(gateway: Service, api_key: str) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30)


@pytest.fixture(scope="module")
def other_tenant(gateway: Service, database_url: str) -> httpx.Client:
    key = asyncio.run(create_key(database_url, name="resume-other", limits=KeyLimits(), tenant="resume-other"))
    return httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": SIM_MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "stream": True, **extra}


def resume(http: httpx.Client, completion_id: str, last_event_id: str | None = None, **params: str) -> httpx.Response:
    headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
    return http.get(f"/v1/chat/completions/{completion_id}/stream", headers=headers, params=params)


def stored_answer(http: httpx.Client, session_id: str, timeout_s: float = 10) -> dict:
    """The session's last message once it is a stored answer (the turn goes on without its client)."""
    deadline = time.monotonic() + timeout_s
    while True:
        messages = http.get(f"/v1/sessions/{session_id}/messages").json()["data"]
        if messages and messages[-1]["role"] == "assistant":
            return messages[-1]
        assert time.monotonic() < deadline, messages
        time.sleep(0.05)


def test_a_dropped_session_stream_resumes_where_it_stopped(http: httpx.Client, other_tenant: httpx.Client) -> None:
    session_id = http.post("/v1/sessions", json={}).json()["id"]
    body = chat_body(session_id=session_id, max_tokens=120, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        first = events_of(response, stop_after=5)  # then the client drops the connection
    completion_id = json.loads(first[0].data)["id"]
    assert [e.id for e in first] == ["0", "1", "2", "3", "4"]

    rest_response = resume(http, completion_id, last_event_id=first[-1].id)  # at once: the answer goes on
    assert rest_response.status_code == 200
    assert rest_response.headers["content-type"].startswith("text/event-stream")
    rest = events_of(rest_response)
    assert rest[-1].done
    *chunk_events, usage_event, _ = rest
    assert [int(e.id or -1) for e in chunk_events] == list(range(5, 5 + len(chunk_events)))
    assert usage_event.id == str(int(chunk_events[-1].id or 0) + 1)
    assert '"usage"' in usage_event.data
    answer = stored_answer(http, session_id)
    assert answer["status"] == "complete"
    assert "".join(e.delta for e in first + chunk_events) == answer["content"]

    # A replay from the start gives the very events the first connection got.
    replayed = events_of(resume(http, completion_id))
    assert [(e.id, e.data) for e in replayed[:5]] == [(e.id, e.data) for e in first]
    assert [(e.id, e.data) for e in replayed[5:]] == [(e.id, e.data) for e in rest]
    # After the usage event only [DONE] is left; past it there is nothing to resume.
    tail = resume(http, completion_id, starting_after=usage_event.id or "")
    assert [e.data for e in events_of(tail)] == ["[DONE]"]
    past = resume(http, completion_id, last_event_id=str(int(usage_event.id or 0) + 1))
    assert past.status_code == 400 and past.json()["error"]["param"] == "Last-Event-ID"
    assert resume(http, completion_id, last_event_id="five").status_code == 400
    # Another tenant, or an id no stream has: not found.
    for client, stream_id in ((other_tenant, completion_id), (http, "chatcmpl-unknown"), (http, "resp_1")):
        missing = resume(client, stream_id)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_every_event_has_an_id_and_a_sessionless_stream_is_not_resumable(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=4, n=2)) as response:
        events = events_of(response)
    assert events[-1].done and events[-1].id is None
    ids = [e.id for e in events[:-1]]
    assert all(i is not None and i.split(".")[1] in {"0", "1"} for i in ids), ids
    completion_id = json.loads(events[0].data)["id"]
    assert resume(http, completion_id).status_code == 404


def test_only_a_session_turns_stream_gets_a_chat_meta(
    http: httpx.Client, namespace: str, service_urls: ServiceUrls
) -> None:
    # A stored response keeps its job's chunk log, but is resumed through the Responses API: its job
    # gets no chat stream meta (a Redis write and an hour of memory for nothing).
    store = redis.Redis.from_url(service_urls.redis)
    try:

        def count(pattern: str) -> int:
            return sum(1 for _ in store.scan_iter(f"{namespace}:{pattern}:*", count=1000))

        metas, logs = count("chunks-meta"), count("chunks")
        response = http.post("/v1/responses", json={"model": SIM_MODEL, "input": "Hi", "max_output_tokens": 4})
        assert response.status_code == 200 and response.json()["id"].startswith("resp_")
        assert count("chunks") == logs + 1 and count("chunks-meta") == metas
    finally:
        store.close()


@pytest.fixture(scope="module")
def own(stack: Stack, api_key: str) -> Iterator[tuple[Service, httpx.Client]]:
    """A session manager of this module's own (its relay's connection is cut, then it is stopped:
    the last test; its stop's grace is 0 + 5 s), and a client of a gateway in front of it."""
    sessions = stack.start("sessions:resume", env={"AXON_DRAIN_TIMEOUT_S": "0"})
    gateway = stack.start("gateway:resume", env={"AXON_SESSIONS_URL": sessions.url})
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as client:
        yield sessions, client


def test_a_turn_whose_relay_loses_its_stream_goes_on_from_its_chunk_log(
    stack: Stack, http: httpx.Client, own: tuple[Service, httpx.Client]
) -> None:
    # The session manager's pub/sub connection drops mid-answer: its client gets stream_interrupted
    # and resumes, and the turn is not called off: the rest is read from the job's chunk log.
    relaying, client = own
    session_id = client.post("/v1/sessions", json={}).json()["id"]
    with client.stream("POST", "/v1/chat/completions", json=chat_body(session_id=session_id, max_tokens=300)) as r:
        lines = r.iter_lines()
        seen = events_of(lines, stop_after=3)
        assert kill_subscribers(stack.redis_url, relaying.pid) >= 1
        seen += events_of(lines)
    *chunk_events, interrupted, done = seen
    assert json.loads(interrupted.data)["error"]["code"] == "stream_interrupted" and done.done
    completion_id = json.loads(seen[0].data)["id"]
    rest = events_of(resume(http, completion_id, last_event_id=chunk_events[-1].id))
    answer = stored_answer(http, session_id)
    assert answer["status"] == "complete" and rest[-1].done
    assert "".join(e.delta for e in chunk_events + rest[:-1]) == answer["content"]


def test_a_stopping_session_manager_finishes_a_turn_whose_client_left(
    stack: Stack, http: httpx.Client, own: tuple[Service, httpx.Client]
) -> None:
    # Stopped while two turns whose clients left run on from their chunk logs (their relay lost
    # them): no request is open, but the one that ends within the stop's grace (5 s) is stored
    # complete before the session manager closes its connections, and the one that would not is
    # called off at the grace's end rather than holding the stop up.
    stopping, client = own
    short_id, long_id = (client.post("/v1/sessions", json={}).json()["id"] for _ in range(2))
    with client.stream("POST", "/v1/chat/completions", json=chat_body(session_id=short_id, max_tokens=200)) as r:
        first = events_of(r, stop_after=3)
    with client.stream("POST", "/v1/chat/completions", json=chat_body(session_id=long_id, max_tokens=4000)) as r:
        events_of(r, stop_after=3)
    assert kill_subscribers(stack.redis_url, stopping.pid) >= 1
    started = time.monotonic()
    assert stopping.stop() == 0
    assert time.monotonic() - started < 9  # 4,000 tokens 5 ms apart take 20 s
    answer = stored_answer(http, short_id, timeout_s=1)
    assert answer["status"] == "complete"
    completion_id = json.loads(first[0].data)["id"]
    assert "".join(e.delta for e in events_of(resume(http, completion_id))[:-1]) == answer["content"]
    assert stored_answer(http, long_id, timeout_s=1)["status"] == "cancelled"
