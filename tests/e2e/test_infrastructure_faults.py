"""The platform survives its infrastructure: RabbitMQ and Redis restarted under steady load, and
PostgreSQL missing when the services start. Each test runs its own private server (a spare
loopback port, data in a temporary folder) and its own Axon processes, so it can stop the server
without touching anything shared. Each prints a one-line summary (`pytest -s` shows it), the
figures `docs/resilience.md` records.
"""

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from shared.keys import KeyLimits
from shared.migrations import migrate
from tests.conftest import create_key
from tests.e2e.load import Load, report, steady, stream_request
from tests.e2e.servers import PrivatePostgres, PrivateRabbitMQ, PrivateRedis, available
from tests.e2e.stack import Stack
from tests.machine import missing
from tests.services import ServiceUrls

pytestmark = pytest.mark.e2e

MODEL = "faults-sim"
SIM = {"AXON_ENGINE": "sim", "AXON_MODEL": MODEL, "AXON_SIM_TTFT_MS": "20", "AXON_SIM_ITL_MS": "10"}
MESSAGES = [{"role": "user", "content": "Tell me something."}]
UNLIMITED = KeyLimits(rpm=1_000_000, tpm=100_000_000, max_concurrent=10_000)


def _require(server: str) -> None:
    if not available()[server]:
        missing(f"no {server} server binaries on this machine")


@pytest.fixture
def own_stack(tmp_path: Path, database_url: str, service_urls: ServiceUrls) -> Iterator[Stack]:
    stack = Stack(
        namespace=f"axon_test_faults_{uuid.uuid4().hex[:8]}",
        database_url=database_url,
        redis_url=service_urls.redis,
        amqp_url=service_urls.amqp,
        log_dir=tmp_path,
    )
    try:
        yield stack
    finally:
        stack.close()


async def _wait_until(check, timeout_s: float, interval_s: float = 0.2) -> float:
    """Poll `check()` until true; returns how long it took."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(interval_s)
    return time.monotonic() - started


async def _restart_under_load(load: Load, send, server, *, streams: int) -> tuple[float, float, float]:
    """Steady load for 4 s, `server` stopped for 3 s and started again, then 3 s more of load.

    Returns:
        How long the server was down, when it was up again (monotonic), and how long after that
        the first request completed.
    """
    stop = asyncio.Event()
    running = asyncio.create_task(steady(load, send, streams=streams, stop=stop))
    await asyncio.sleep(4)
    stopped_at = time.monotonic()
    await asyncio.to_thread(server.stop)
    await asyncio.sleep(3)
    await asyncio.to_thread(server.start)
    up_at = time.monotonic()
    recovery_s = await _wait_until(
        lambda: asyncio.sleep(0, result=load.first_completed_after(up_at) is not None), timeout_s=30
    )
    await asyncio.sleep(3)
    stop.set()
    await running
    return up_at - stopped_at, up_at, recovery_s


async def test_rabbitmq_restarted_under_steady_load(own_stack: Stack, tmp_path: Path, api_key: str) -> None:
    _require("rabbitmq")
    broker = PrivateRabbitMQ(tmp_path / "rabbitmq")
    broker.start()
    try:
        env = {"AXON_AMQP_URL": broker.url}
        worker = own_stack.start("worker:faults", env={**SIM, **env})
        sessions = own_stack.start("sessions", env=env)
        gateway = own_stack.start("gateway", env={**env, "AXON_SESSIONS_URL": sessions.url})
        url = f"{gateway.url}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {api_key}"}
        load = Load()
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5)) as client:

            async def send(stream: int, n: int):
                body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 30}
                return await stream_request(client, url, body, headers, deadline_s=60)

            down_s, up_at, recovery_s = await _restart_under_load(load, send, broker, streams=6)
    finally:
        broker.stop()
    counts = load.counts()
    report("rabbitmq restart", **counts, down_s=round(down_s, 1), recovery_s=round(recovery_s, 1))
    assert counts["lost"] == counts["hung"] == 0, load.problems()
    assert recovery_s <= 10
    assert counts["completed"] > 20 and load.first_completed_after(up_at + recovery_s) is not None
    # Its broker gone for good, a worker still stops: its drain does not wait for the broker (it
    # waited for ever before).
    stopping = time.monotonic()
    assert worker.stop(timeout_s=20) == 0
    assert time.monotonic() - stopping < 10


async def test_redis_restarted_under_steady_load_loses_no_acknowledged_history(
    own_stack: Stack, tmp_path: Path, database_url: str
) -> None:
    _require("redis")
    cache = PrivateRedis(tmp_path / "redis")
    cache.start()
    try:
        env = {"AXON_REDIS_URL": cache.url}
        own_stack.start("worker:faults", env={**SIM, **env})
        sessions = own_stack.start("sessions", env=env)
        gateway = own_stack.start("gateway", env={**env, "AXON_SESSIONS_URL": sessions.url})
        key = await create_key(database_url, name="redis-restart", limits=UNLIMITED, tenant=f"t-{uuid.uuid4().hex[:6]}")
        headers = {"Authorization": f"Bearer {key}"}
        load = Load()
        answered: dict[str, list[tuple[str, str]]] = {}  # session -> the turns its client was given
        async with httpx.AsyncClient(base_url=gateway.url, timeout=httpx.Timeout(60, connect=5)) as client:
            session_ids = [(await client.post("/v1/sessions", json={}, headers=headers)).json()["id"] for _ in range(6)]

            async def send(stream: int, n: int):
                session_id, question = session_ids[stream], f"turn {n} of session {stream}"
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": question}],
                    "max_tokens": 20,
                    "session_id": session_id,
                }
                outcome = await stream_request(client, "/v1/chat/completions", body, headers, deadline_s=60)
                if outcome.kind == "completed":
                    answered.setdefault(session_id, []).append((question, outcome.text))
                return outcome

            down_s, _, recovery_s = await _restart_under_load(load, send, cache, streams=len(session_ids))
            # Every turn a client was answered is in PostgreSQL once the outbox drains, in order.
            pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
            try:

                async def all_persisted() -> bool:
                    for session_id, turns in answered.items():
                        rows = await pool.fetch(
                            "SELECT role, content FROM messages WHERE conversation_id = $1 ORDER BY seq",
                            uuid.UUID(session_id),
                        )
                        stored = [(r["role"], r["content"]) for r in rows]
                        expected = [pair for q, a in turns for pair in (("user", q), ("assistant", a))]
                        if not _in_order(expected, stored):
                            return False
                    return True

                persisted_s = await _wait_until(all_persisted, timeout_s=30, interval_s=0.5)
            finally:
                await pool.close()
    finally:
        cache.stop()
    counts = load.counts()
    turns = sum(len(t) for t in answered.values())
    report(
        "redis restart",
        **counts,
        down_s=round(down_s, 1),
        recovery_s=round(recovery_s, 1),
        answered_turns=turns,
        persisted_after_s=round(persisted_s, 1),
        history_lost=0,
    )
    assert counts["lost"] == counts["hung"] == 0, load.problems()
    assert recovery_s <= 5
    assert turns > 20


def _in_order(expected: list[tuple[str, str]], stored: list[tuple[str, str]]) -> bool:
    """Every expected message is stored, in this order (other stored messages, e.g. answers that
    failed during the outage, may come between)."""
    position = 0
    for message in expected:
        try:
            position = stored.index(message, position) + 1
        except ValueError:
            return False
    return True


async def test_postgres_down_at_start_up_then_ready_when_it_appears(own_stack: Stack, tmp_path: Path) -> None:
    _require("postgres")
    database = PrivatePostgres(tmp_path)
    database.start()
    try:
        url = database.admin_url.rsplit("/", 1)[0] + "/axon"
        await migrate(url)
        key = await create_key(url, name="pg-down", limits=UNLIMITED, tenant="pg-down")
        await asyncio.to_thread(database.stop)

        env = {"AXON_DATABASE_URL": url}
        own_stack.start("worker:faults", env={**SIM, **env})
        sessions = own_stack.start("sessions", env=env, ready_path="/health")
        gateway = own_stack.start("gateway", env={**env, "AXON_SESSIONS_URL": sessions.url}, ready_path="/health")
        async with httpx.AsyncClient(timeout=10) as client:
            await asyncio.sleep(3)  # long enough for a crash loop to show
            for service in (sessions, gateway):
                assert service.process.poll() is None, f"{service.name} exited:\n{service.log_text()[-2000:]}"
            not_ready = (await client.get(f"{sessions.url}/ready")).json()
            assert not_ready["status"] == "not_ready" and "PostgreSQL" in not_ready["reason"]
            gateway_reason = (await client.get(f"{gateway.url}/ready")).json()["reason"]
            assert "PostgreSQL" in gateway_reason

            await asyncio.to_thread(database.start)
            appeared = time.monotonic()

            async def ready() -> bool:
                answers = [await client.get(f"{s.url}/ready") for s in (sessions, gateway)]
                return all(a.status_code == 200 for a in answers)

            ready_s = await _wait_until(ready, timeout_s=20)
            headers = {"Authorization": f"Bearer {key}"}
            created = await client.post(f"{gateway.url}/v1/sessions", json={"title": "after"}, headers=headers)
            assert created.status_code == 201, created.text
            answer = await client.post(
                f"{gateway.url}/v1/chat/completions",
                headers=headers,
                json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "session_id": created.json()["id"]},
            )
            assert answer.status_code == 200, answer.text
        report(
            "postgres down at start-up",
            crashed=0,
            not_ready_reason=not_ready["reason"][:80],
            ready_after_s=round(time.monotonic() - appeared, 1) if ready_s else 0,
        )
    finally:
        database.stop()
        database.remove()
