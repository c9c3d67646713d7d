"""Session affinity end to end: three sim workers with the prefix-cache model behind the shared
session manager and gateway. A session's turns stay on one worker and hit its cache; a busy home
spills the turn to another worker after AXON_AFFINITY_WAIT_MS; a killed home costs one miss and
no turn; a draining home's session moves on."""

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from openai import OpenAI

from services.cli.launcher import Service
from shared.names import Names
from tests.e2e.stack import INTERNAL_AUTH, INTERNAL_TOKEN, Stack
from tests.e2e.test_workers import metric
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

MODEL = "affinity-sim"
# One sequence at a time per worker, so a long answer makes its worker busy; fast tokens.
WORKER_ENV = {
    "AXON_ENGINE": "sim",
    "AXON_MODEL": MODEL,
    "AXON_SIM_MAX_SEQS": "1",
    "AXON_SIM_TTFT_MS": "10",
    "AXON_SIM_ITL_MS": "5",
    "AXON_SIM_KV_BLOCKS": "4096",
    "AXON_DRAIN_TIMEOUT_S": "10",
}
# 200 words after the session's id and the turn's number (a prompt of its own: no two sessions
# share a cached block), twelve full 16-token blocks (the sim's tokens are words).
WORDS = " ".join(f"word{i}" for i in range(200))


class Sessions:
    """Session turns over the public API, and each session's home as its worker recorded it."""

    def __init__(self, gateway: Service, api_key: str, stack: Stack) -> None:
        self.http = httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
        self.redis = redis.Redis.from_url(stack.redis_url)
        self.names = Names(stack.namespace)
        self.turns: dict[str, int] = {}

    def new(self) -> str:
        response = self.http.post("/v1/sessions", json={"title": "affinity"})
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def turn(self, session_id: str, *, max_tokens: int = 8) -> dict:
        self.turns[session_id] = self.turns.get(session_id, 0) + 1
        question = f"{session_id} {self.turns[session_id]} {WORDS}"
        body = {
            "model": MODEL,
            "session_id": session_id,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
        }
        response = self.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def home(self, session_id: str) -> str:
        raw = self.redis.get(self.names.affinity(session_id))
        assert raw is not None, "no affinity record"
        return bytes(raw).decode()


def routed(stack: Stack, route: str, model: str = MODEL) -> float:
    """The shared session manager's `axon_sessions_jobs_routed_total` for `model` (this module's)."""
    manager = next(s for s in stack.services if s.name == "sessions")
    text = httpx.get(f"{manager.url}/metrics", headers=INTERNAL_AUTH, timeout=10).text
    wanted = f'axon_sessions_jobs_routed_total{{model="{model}",route="{route}"}} '
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(wanted)), 0.0)


def cached(answer: dict) -> int:
    return int(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


@pytest.fixture(scope="module")
def workers(stack: Stack) -> Iterator[dict[str, Service]]:
    started = {
        f"aff-{i}": stack.start(f"worker:aff-{i}", env={**WORKER_ENV, "AXON_WORKER_ID": f"aff-{i}"}) for i in range(3)
    }
    yield started
    for worker in started.values():
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)


@pytest.fixture(scope="module")
def sessions(workers: dict[str, Service], gateway: Service, api_key: str, stack: Stack) -> Sessions:
    """Turns through the shared stack, once its session manager counts the three workers live: a
    worker is a home only once the manager's model catalog (cached up to 1 s) lists it, and a turn
    whose home it does not list goes to the shared queue (the polled gauge reads that catalog)."""
    manager = next(s for s in stack.services if s.name == "sessions")
    wait_for(
        lambda: metric(manager, "axon_sessions_live_workers", model=MODEL) == len(workers),
        timeout_s=30,
        what=f"the session manager counting the {len(workers)} workers of {MODEL} live",
    )
    return Sessions(gateway, api_key, stack)


def homed_pair(sessions: Sessions, live: set[str]) -> tuple[str, str, str]:
    """Two sessions whose first turns were served by the same live worker (pigeonhole: at most
    one more session than there are live workers), and that worker."""
    by_home: dict[str, str] = {}
    for _ in range(len(live) + 1):
        session_id = sessions.new()
        sessions.turn(session_id)
        home = sessions.home(session_id)
        assert home in live
        if home in by_home:
            return by_home[home], session_id, home
        by_home[home] = session_id
    raise AssertionError("no two sessions share a home")


def test_a_sessions_turns_stay_on_one_worker_and_reuse_its_prefix_cache(stack: Stack, sessions: Sessions) -> None:
    home_before = routed(stack, "home")
    for _ in range(3):
        session_id = sessions.new()
        first = sessions.turn(session_id)
        home = sessions.home(session_id)
        assert cached(first) == 0  # a new conversation: nothing of it is cached anywhere
        for _turn in range(3):
            answer = sessions.turn(session_id)
            assert sessions.home(session_id) == home
            # The whole previous prompt and answer are cached; only the new question is not.
            assert cached(answer) >= answer["usage"]["prompt_tokens"] - 220 > 0
    assert routed(stack, "home") - home_before == 9  # every turn after the first went to its home


def test_prefix_affinity_keeps_a_client_kept_conversation_on_one_worker(stack: Stack, sessions: Sessions) -> None:
    """Opt-in (AXON_PREFIX_AFFINITY): a sessionless chat that resends its history goes to the worker
    its first exchange hashes to, so from its third turn on the whole history is cached."""
    manager = stack.start("sessions:prefix", env={"AXON_PREFIX_AFFINITY": "true"})
    client = OpenAI(
        base_url=f"{manager.url}/v1",
        api_key=INTERNAL_TOKEN,  # straight to the session manager: the internal token is the bearer
        default_headers={"x-axon-tenant": "tests"},
        max_retries=0,
        timeout=30,
    )
    for conversation in range(3):
        history: list = []
        for turn in range(1, 5):
            history.append({"role": "user", "content": f"client-kept {conversation} {turn} {WORDS}"})
            answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
            history.append({"role": "assistant", "content": answer.choices[0].message.content})
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            if turn >= 3:
                assert answer.usage.prompt_tokens_details.cached_tokens >= answer.usage.prompt_tokens - 220 > 0
    manager.stop()


def generating(worker: Service) -> None:
    """Until `worker` runs a sequence: the long turn started on its home."""
    wait_for(
        lambda: metric(worker, "axon_worker_running_sequences", model=MODEL) >= 1, timeout_s=10, what="the long turn"
    )


def test_a_turn_whose_home_is_busy_spills_to_another_worker(sessions: Sessions, workers: dict[str, Service]) -> None:
    long_one, waiting, home = homed_pair(sessions, {"aff-0", "aff-1", "aff-2"})
    long_done: list[float] = []

    def long_turn() -> None:  # ~2 s on its home
        sessions.turn(long_one, max_tokens=400)
        long_done.append(time.monotonic())

    busy = threading.Thread(target=long_turn)
    busy.start()
    generating(workers[home])
    started = time.monotonic()
    answer = sessions.turn(waiting)
    answered = time.monotonic()
    busy.join(timeout=30)
    # Waited the affinity wait (250 ms) in the busy home's queue, then another worker took it and
    # answered before the home was free again.
    assert answered - started >= 0.2
    assert long_done and answered < long_done[0]
    assert sessions.home(waiting) != home
    assert sessions.home(long_one) == home
    assert cached(answer) == 0  # a miss on its new worker, once
    assert cached(sessions.turn(waiting)) > 0


def test_a_killed_home_costs_one_miss_and_no_turn(sessions: Sessions, workers: dict[str, Service]) -> None:
    session_id = sessions.new()
    sessions.turn(session_id)
    home = sessions.home(session_id)
    workers[home].kill()
    # Its heartbeat is still live: the turn waits in its queue, then any worker takes it.
    answer = sessions.turn(session_id)
    new_home = sessions.home(session_id)
    assert new_home != home
    assert cached(answer) == 0
    following = sessions.turn(session_id)
    assert sessions.home(session_id) == new_home
    assert cached(following) > 0


def test_a_draining_homes_sessions_move_on(sessions: Sessions, workers: dict[str, Service]) -> None:
    live = {worker_id for worker_id, worker in workers.items() if worker.process.poll() is None}
    long_one, waiting, home = homed_pair(sessions, live)
    busy = threading.Thread(target=sessions.turn, args=(long_one,), kwargs={"max_tokens": 400})
    busy.start()
    generating(workers[home])
    workers[home].process.send_signal(signal.SIGTERM)  # drains: its in-flight answer finishes
    answer = sessions.turn(waiting)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert sessions.home(waiting) in live - {home}
    busy.join(timeout=30)
    assert workers[home].process.wait(timeout=20) == 0
    assert sessions.home(long_one) == home  # finished on its home during the drain
