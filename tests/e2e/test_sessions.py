"""Sessions and durable history through real processes, real Redis and real PostgreSQL."""

import asyncio
import json
import threading
import time
import uuid

import asyncpg
import httpx
import pytest
import redis.asyncio as redis

from services.cli.launcher import Service
from shared.keys import KeyLimits
from shared.names import Names
from tests.conftest import create_key
from tests.contract.openai_shapes import assert_openai_stream
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.load import report
from tests.e2e.stack import INTERNAL_AUTH, Stack
from tests.e2e.tcpproxy import TcpProxy
from tests.services import ServiceUrls

pytestmark = pytest.mark.e2e


class Api:
    """Thin client for the public API with one key."""

    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def chat(self, session_id: str, content: str, **extra) -> httpx.Response:
        body = {
            "model": SIM_MODEL,
            "session_id": session_id,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 5,
            **extra,
        }
        return self.http.post("/v1/chat/completions", json=body)

    def new_session(self, **fields) -> str:
        response = self.http.post("/v1/sessions", json=fields)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def messages(self, session_id: str) -> list[dict]:
        response = self.http.get(f"/v1/sessions/{session_id}/messages", params={"limit": 500})
        assert response.status_code == 200, response.text
        return response.json()["data"]


@pytest.fixture(scope="module")
def api(gateway: Service, api_key: str) -> Api:
    return Api(gateway.url, api_key)


@pytest.fixture(scope="module")
def other_tenant(gateway: Service, database_url: str) -> Api:
    key = asyncio.run(create_key(database_url, name="other", limits=KeyLimits(), tenant="someone-else"))
    return Api(gateway.url, key)


async def _db_messages(database_url: str, session_id: str) -> list[tuple[int, str, str, str]]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT seq, role, content, status FROM messages WHERE conversation_id = $1 ORDER BY seq",
            uuid.UUID(session_id),
        )
        return [tuple(r) for r in rows]
    finally:
        await conn.close()


def wait_persisted(database_url: str, session_id: str, count: int, timeout_s: float = 10) -> list[tuple]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = asyncio.run(_db_messages(database_url, session_id))
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_session_crud_and_pagination(api: Api) -> None:
    ids = [api.new_session(title=f"s{i}") for i in range(3)]
    got = api.http.get(f"/v1/sessions/{ids[0]}").json()
    assert got["title"] == "s0" and got["object"] == "session"
    page1 = api.http.get("/v1/sessions", params={"limit": 2}).json()
    assert [s["id"] for s in page1["data"]] == [ids[2], ids[1]] and page1["has_more"]
    page2 = api.http.get("/v1/sessions", params={"limit": 2, "after": ids[1]}).json()
    assert page2["data"][0]["id"] == ids[0]
    renamed = api.http.patch(f"/v1/sessions/{ids[0]}", json={"title": "renamed"})
    assert renamed.status_code == 200 and renamed.json()["title"] == "renamed"
    assert api.http.delete(f"/v1/sessions/{ids[0]}").status_code == 200
    assert api.http.get(f"/v1/sessions/{ids[0]}").status_code == 404
    assert api.http.get("/v1/sessions/not-a-uuid").status_code == 404


def test_other_tenant_gets_404_never_data(api: Api, other_tenant: Api) -> None:
    session_id = api.new_session(title="private")
    assert api.chat(session_id, "secret plans").status_code == 200
    for response in (
        other_tenant.http.get(f"/v1/sessions/{session_id}"),
        other_tenant.http.get(f"/v1/sessions/{session_id}/messages"),
        other_tenant.http.patch(f"/v1/sessions/{session_id}", json={"title": "mine"}),
        other_tenant.http.delete(f"/v1/sessions/{session_id}"),
        other_tenant.chat(session_id, "let me in"),
    ):
        assert response.status_code == 404, response.text
        assert "secret" not in response.text and response.json()["error"]["code"] == "session_not_found"
    assert session_id not in other_tenant.http.get("/v1/sessions").text
    assert api.http.get(f"/v1/sessions/{session_id}").status_code == 200


def test_chat_in_a_session_uses_and_stores_history(api: Api, database_url: str) -> None:
    session_id = api.new_session(system_prompt="You are terse.")
    first = api.chat(session_id, "one two three")
    second = api.chat(session_id, "four")
    assert first.status_code == second.status_code == 200
    assert first.headers["x-axon-history-dropped"] == "0"
    # The sim counts prompt words: the second prompt holds the system prompt, turn one and its answer.
    assert second.json()["usage"]["prompt_tokens"] > first.json()["usage"]["prompt_tokens"] + 5
    stored = api.messages(session_id)
    assert [(m["seq"], m["role"], m["status"]) for m in stored] == [
        (1, "user", "complete"),
        (2, "assistant", "complete"),
        (3, "user", "complete"),
        (4, "assistant", "complete"),
    ]
    assert stored[1]["content"] == first.json()["choices"][0]["message"]["content"]
    assert stored[3]["content"] == second.json()["choices"][0]["message"]["content"]
    rows = wait_persisted(database_url, session_id, 4)
    assert [(r[0], r[1], r[2]) for r in rows] == [(m["seq"], m["role"], m["content"]) for m in stored]


def test_streamed_answer_is_stored_and_concurrent_turn_is_409(api: Api, gateway: Service, api_key: str) -> None:
    session_id = api.new_session()
    body = {
        "model": SIM_MODEL,
        "session_id": session_id,
        "stream": True,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "long answer please"}],
    }
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers, timeout=30) as stream:
        lines = stream.iter_lines()
        next(lines)
        busy = api.chat(session_id, "me too")
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"
        for _ in range(6):
            next(lines)
    # The client went away mid-answer: a session turn's stream can be resumed, so the turn goes on
    # to its end and its whole answer is stored (test_chat_resume.py resumes one).
    deadline = time.monotonic() + 10
    while len(api.messages(session_id)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    answer = api.messages(session_id)[1]
    assert answer["role"] == "assistant" and answer["status"] == "complete" and answer["content"]
    assert api.chat(session_id, "and now?").status_code == 200  # the session is free again


def test_history_beyond_the_context_is_left_out_of_the_prompt_not_the_store(stack: Stack, api: Api) -> None:
    stack.start(
        "worker:tiny",
        env={
            "AXON_ENGINE": "sim",
            "AXON_MODEL": "tiny-context",
            "AXON_SIM_CONTEXT_TOKENS": "200",
            "AXON_SIM_TTFT_MS": "0",
            "AXON_SIM_ITL_MS": "0",
        },
    )
    session_id = api.new_session(system_prompt="sys")
    deadline = time.monotonic() + 5
    while api.chat(session_id, "warm up", model="tiny-context").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    dropped = []
    for _ in range(6):
        response = api.chat(session_id, "word " * 60, model="tiny-context", max_tokens=10)
        assert response.status_code == 200, response.text
        dropped.append(int(response.headers["x-axon-history-dropped"]))
    assert dropped[0] == 0 and dropped[-1] > 0
    assert len(api.messages(session_id)) == 14  # everything is stored


def test_history_reloads_from_postgres_when_the_cache_is_dropped(
    api: Api, namespace: str, database_url: str, service_urls: ServiceUrls
) -> None:
    session_id = api.new_session(system_prompt="remember")
    for word in ("alpha", "beta", "gamma"):
        assert api.chat(session_id, word).status_code == 200
    before = api.messages(session_id)
    wait_persisted(database_url, session_id, 6)

    async def drop_cache() -> None:
        client = redis.Redis.from_url(service_urls.redis)
        names = Names(namespace)
        await client.delete(names.history(session_id), names.session(session_id), names.session_seq(session_id))
        await client.aclose()

    asyncio.run(drop_cache())
    assert api.messages(session_id) == before
    again = api.chat(session_id, "delta")
    assert again.status_code == 200
    after = api.messages(session_id)
    assert after[:6] == before and [m["seq"] for m in after] == list(range(1, 9))


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_session_stores_and_replays_tool_calls(
    api: Api, namespace: str, database_url: str, service_urls: ServiceUrls
) -> None:
    """A streamed answer that calls a tool is stored with its calls, the tool's result with the
    call it answers; both are listed in OpenAI's message shape, persisted, and survive a reload
    of the history from PostgreSQL."""
    session_id = api.new_session()
    question = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"model": SIM_MODEL, "session_id": session_id, "stream": True, "tools": [WEATHER_TOOL], "messages": question}
    with api.http.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        chunks = assert_openai_stream("CreateChatCompletionStreamResponse", stream.iter_lines())
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    call_id = deltas[0]["id"]
    arguments = "".join(d["function"].get("arguments") or "" for d in deltas)
    assert json.loads(arguments).keys() == {"city"}

    result = {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": "22 C and sunny"}
    follow_up = api.http.post(
        "/v1/chat/completions",
        json={
            "model": SIM_MODEL,
            "session_id": session_id,
            "max_tokens": 5,
            "tools": [WEATHER_TOOL],
            "messages": [result],
        },
    )
    assert follow_up.status_code == 200, follow_up.text
    assert follow_up.json()["choices"][0]["message"]["content"]  # an answer to the result, not another call

    stored = api.messages(session_id)
    assert [(m["role"], m["status"]) for m in stored] == [
        ("user", "complete"),
        ("assistant", "complete"),
        ("tool", "complete"),
        ("assistant", "complete"),
    ]
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    assert stored[1]["content"] is None and stored[1]["tool_calls"] == [call]
    assert (stored[2]["tool_call_id"], stored[2]["name"], stored[2]["content"]) == (
        call_id,
        "get_weather",
        "22 C and sunny",
    )
    assert "tool_calls" not in stored[3] and "tool_call_id" not in stored[0]

    wait_persisted(database_url, session_id, 4)

    async def persisted_and_dropped() -> list[tuple]:
        conn = await asyncpg.connect(database_url)
        try:
            rows = await conn.fetch(
                "SELECT tool_calls, tool_call_id, name FROM messages WHERE conversation_id = $1 ORDER BY seq",
                uuid.UUID(session_id),
            )
        finally:
            await conn.close()
        client = redis.Redis.from_url(service_urls.redis)
        await client.delete(Names(namespace).history(session_id))
        await client.aclose()
        return [(json.loads(r["tool_calls"]) if r["tool_calls"] else None, r["tool_call_id"], r["name"]) for r in rows]

    assert asyncio.run(persisted_and_dropped()) == [
        (None, None, None),
        ([call], None, None),
        (None, call_id, "get_weather"),
        (None, None, None),
    ]
    assert api.messages(session_id) == stored  # read back from PostgreSQL
    # The next turn's prompt is built from the reloaded history, calls included.
    assert api.chat(session_id, "Thanks").status_code == 200


def test_deleted_session_is_gone_from_postgres_and_redis(
    api: Api, namespace: str, database_url: str, service_urls: ServiceUrls
) -> None:
    session_id = api.new_session()
    assert api.chat(session_id, "hello").status_code == 200
    wait_persisted(database_url, session_id, 2)
    assert api.http.delete(f"/v1/sessions/{session_id}").status_code == 200
    assert asyncio.run(_db_messages(database_url, session_id)) == []

    async def cached() -> int:
        client = redis.Redis.from_url(service_urls.redis)
        names = Names(namespace)
        count = await client.exists(names.history(session_id), names.session_seq(session_id))
        await client.aclose()
        return count

    assert asyncio.run(cached()) == 0


def _burst(
    api_url: str, key: str, session_ids: list[str], turns: int, answered: list, stop_at: float | None = None
) -> None:
    """Chat `turns` times in each session (turns in a session one after another); record answered turns."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=15) as http:

            async def session_turns(session_id: str) -> None:
                for turn in range(turns):
                    content = f"{session_id[:8]} turn {turn}"
                    try:
                        r = await http.post(
                            "/v1/chat/completions",
                            json={
                                "model": SIM_MODEL,
                                "session_id": session_id,
                                "max_tokens": 3,
                                "messages": [{"role": "user", "content": content}],
                            },
                        )
                    except httpx.HTTPError:
                        await asyncio.sleep(0.2)
                        continue
                    if r.status_code == 200:
                        answered.append((session_id, content, r.json()["choices"][0]["message"]["content"]))
                    else:
                        await asyncio.sleep(0.2)

            await asyncio.gather(*(session_turns(s) for s in session_ids))

    asyncio.run(run())


def test_kill_9_session_manager_mid_burst_loses_no_answered_message(
    stack: Stack, api_key: str, database_url: str
) -> None:
    env = {"AXON_PERSIST_RECLAIM_AFTER_MS": "1000"}
    victim = stack.start("sessions:victim", env=env)
    gateway = stack.start("gateway:victim", env={"AXON_SESSIONS_URL": victim.url})
    api = Api(gateway.url, api_key)
    session_ids = [api.new_session(title=f"burst {i}") for i in range(20)]
    answered: list = []
    burst = threading.Thread(target=_burst, args=(gateway.url, api_key, session_ids, 10, answered))
    burst.start()
    deadline = time.monotonic() + 20
    while len(answered) < 80 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.kill()
    burst.join(timeout=60)
    assert len(answered) >= 80
    stack.start("sessions:revived", env=env, port=victim.port)
    started = time.monotonic()
    for session_id in session_ids:
        mine = [(c, a) for s, c, a in answered if s == session_id]
        rows = wait_persisted(
            database_url, session_id, 2 * len(mine), timeout_s=max(0.5, 10 - (time.monotonic() - started))
        )
        seqs = [r[0] for r in rows]
        assert seqs == sorted(set(seqs)), "duplicates or disorder"
        contents = [(r[1], r[2]) for r in rows]
        for question, answer in mine:
            index = contents.index(("user", question))
            assert contents[index + 1] == ("assistant", answer)
    persisted_s = time.monotonic() - started
    assert persisted_s < 10
    report(
        "session manager kill -9 mid-burst",
        sent=200,
        completed=len(answered),
        errored=200 - len(answered),
        lost=0,
        persisted_within_s=round(persisted_s, 1),
    )
    # Turn locks the dead process held are taken over once its liveness key expires (10 s).
    api = Api(gateway.url, api_key)
    deadline = time.monotonic() + 15
    for session_id in session_ids:
        while (status := api.chat(session_id, "after the crash").status_code) != 200:
            assert status in {409, 502, 503} and time.monotonic() < deadline, status
            time.sleep(0.5)


def test_postgres_down_30s_chats_go_on_and_outbox_drains(stack: Stack, api_key: str, database_url: str) -> None:
    proxy = TcpProxy.to(database_url)
    proxied_url = proxy.proxied(database_url)
    try:
        # A namespace of its own: no other session manager's persister may drain this outbox.
        own = {"AXON_NAMESPACE": f"{stack.namespace}-pg"}
        stack.start(
            "worker:pg-proxy", env={**own, "AXON_ENGINE": "sim", "AXON_MODEL": SIM_MODEL, "AXON_SIM_ITL_MS": "1"}
        )
        sessions = stack.start("sessions:pg-proxy", env={**own, "AXON_DATABASE_URL": proxied_url})
        gateway = stack.start("gateway:pg-proxy", env={**own, "AXON_SESSIONS_URL": sessions.url})
        api = Api(gateway.url, api_key)
        session_ids = [api.new_session(title=f"outage {i}") for i in range(5)]
        for session_id in session_ids:
            assert api.chat(session_id, "before").status_code == 200
        proxy.cut()
        answered = []
        outage_end = time.monotonic() + 30
        turn = 0
        while time.monotonic() < outage_end:
            for session_id in session_ids:
                response = api.chat(session_id, f"during {turn}")
                assert response.status_code == 200, response.text
                answered.append(session_id)
            turn += 1
            time.sleep(0.5)
        backlog = int(_metric(sessions, "axon_sessions_outbox_length"))
        assert backlog >= len(answered)  # nothing could be written meanwhile
        proxy.restore()
        restored = time.monotonic()
        deadline = restored + 20
        while _metric(sessions, "axon_sessions_outbox_length") > 0:
            assert time.monotonic() < deadline, "the outbox did not drain after PostgreSQL returned"
            time.sleep(0.5)
        drained_s = time.monotonic() - restored
        for session_id in session_ids:
            rows = asyncio.run(_db_messages(database_url, session_id))
            expected = 2 + 2 * answered.count(session_id)
            assert [r[0] for r in rows] == list(range(1, expected + 1))
        report(
            "postgresql down 30 s under load",
            sent=len(answered),
            completed=len(answered),
            errored=0,
            lost=0,
            outbox_peak=backlog,
            drained_within_s=round(drained_s, 1),
        )
    finally:
        proxy.close()


def _metric(service: Service, name: str) -> float:
    for line in httpx.get(f"{service.url}/metrics", headers=INTERNAL_AUTH, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")
