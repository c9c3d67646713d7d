"""Routing on the prefix index end to end: two sim workers publishing their prefix caches' KV-cache
events (every fifth batch lost, and replayed from the engine's buffer), behind a session manager
of the module's own. One-shot requests about documents meet their documents; the longest cached
prefix wins; a busy home spills; Redis losing the index heals; a worker's death costs no request
and its restart joins; Redis away from a worker costs no request, and its set is written again."""

import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
import redis

from services.cli.launcher import Service
from shared.names import Names
from shared.prefix_index import anchors
from shared.schemas import Message
from tests.e2e.stack import INTERNAL_TOKEN, Stack
from tests.e2e.tcpproxy import TcpProxy
from tests.e2e.test_workers import metric
from tests.services import ServiceUrls
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

MODEL = "prefix-sim"
WORKER_ENV = {
    "AXON_ENGINE": "sim",
    "AXON_MODEL": MODEL,
    "AXON_SIM_MAX_SEQS": "8",
    "AXON_SIM_TTFT_MS": "5",
    "AXON_SIM_ITL_MS": "5",
    "AXON_SIM_KV_BLOCKS": "2000",
    "AXON_SIM_KV_EVENTS_DROP_EVERY": "5",
    "AXON_HEARTBEAT_INTERVAL_S": "1",
    "AXON_HEARTBEAT_TTL_S": "3",
    "AXON_DRAIN_TIMEOUT_S": "5",
}


def words(tag: str, count: int = 300) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


P, Q, R = words("p"), words("q"), words("r")


class Api:
    """Requests straight to the module's session manager (the internal token is the bearer)."""

    def __init__(self, stack: Stack, sessions: Service) -> None:
        headers = {"Authorization": f"Bearer {INTERNAL_TOKEN}", "x-axon-tenant": "tests"}
        self.http = httpx.Client(base_url=sessions.url, headers=headers, timeout=60)
        self.redis = redis.Redis.from_url(stack.redis_url)
        self.names = Names(stack.namespace)
        self.sessions = sessions

    def ask(self, content: str, *, max_tokens: int = 4) -> dict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        response = self.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def holds(self, worker_id: str, content: str) -> int:
        """How far into `content`'s anchors `worker_id`'s set of the index holds it."""
        keys = [a.key for a in anchors(messages=[Message(role="user", content=content)], prompt=None)]
        flags = self.redis.smismember(self.names.prefix_index(MODEL, worker_id), keys)
        return max((i + 1 for i, flag in enumerate(flags) if flag), default=0)

    def holder(self, content: str, workers: list[str]) -> str:
        """The worker whose set holds `content` furthest, once one does."""
        wait_for(lambda: any(self.holds(w, content) for w in workers), timeout_s=10, what="the index to hold it")
        return max(workers, key=lambda w: self.holds(w, content))

    def routes(self, reason: str) -> float:
        return metric(self.sessions, "axon_sessions_prefix_routes_total", model=MODEL, reason=reason)

    def alive(self, worker_id: str) -> bool:
        raw = self.redis.hget(self.names.workers_key, worker_id)
        return raw is not None and orjson.loads(raw)["expires_at"] > time.time()


def cached(answer: dict) -> int:
    return int(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


@pytest.fixture(scope="module")
def workers(stack: Stack) -> Iterator[dict[str, Service]]:
    started = {
        f"px-{i}": stack.start(f"worker:px-{i}", env={**WORKER_ENV, "AXON_WORKER_ID": f"px-{i}"}) for i in range(2)
    }
    yield started


@pytest.fixture(scope="module")
def api(workers: dict[str, Service], stack: Stack) -> Api:
    # A session manager of the module's own, whose index reads may take a loaded machine's time,
    # and which reads the live workers per request (no cache): a worker whose heartbeat a test saw
    # come or go is then in or out of its routing at once, not up to a cache's age later.
    env = {"AXON_PREFIX_LOOKUP_TIMEOUT_MS": "2000", "AXON_PREFIX_SPILL_SEQS": "2", "AXON_MODELS_CACHE_TTL_S": "0"}
    manager = stack.start("sessions:prefix", env=env)
    client = Api(stack, manager)
    wait_for(lambda: MODEL in client.http.get("/v1/models").text, timeout_s=10, what=f"{MODEL} listed")
    return client


def test_one_shot_requests_meet_their_documents_through_lost_and_replayed_events(
    api: Api, workers: dict[str, Service]
) -> None:
    documents = [words(f"doc{d}x") for d in range(6)]
    for document in documents:  # the first round: nobody holds them, the shared queue spreads them
        api.ask(f"{document} question one")
    for document in documents:  # a batch lost last is fetched after a quiet second
        api.holder(document, list(workers))
    before = api.routes("cached_prefix")
    for round_ in range(2):
        for document in documents:
            answer = api.ask(f"{document} question {round_ + 2}")
            # The whole document but its last partial block was cached where it went.
            holds = {w: api.holds(w, f"{document} question {round_ + 2}") for w in workers}
            assert cached(answer) >= 300 - 16, (answer["usage"], holds)
    assert api.routes("cached_prefix") - before == 12
    # Both workers hold documents: the first round spread them, and each stayed where it landed.
    assert all(any(api.holds(w, d) for d in documents) for w in workers)
    replayed = sum(metric(w, "axon_worker_kv_event_gaps_total", healed="replay", model=MODEL) for w in workers.values())
    resynced = sum(metric(w, "axon_worker_kv_event_gaps_total", healed="resync", model=MODEL) for w in workers.values())
    assert replayed > 0 and resynced == 0


def test_the_longest_cached_prefix_wins_and_a_busy_home_spills(api: Api, workers: dict[str, Service]) -> None:
    api.ask(f"{P} {Q} seed")
    home = api.holder(f"{P} {Q}", list(workers))
    other = next(w for w in workers if w != home)
    # Two long answers about P+Q keep its home busy (this session manager's load: 2 there, 0 elsewhere).
    longs = [
        threading.Thread(target=api.ask, args=(f"{P} {Q} long {i}",), kwargs={"max_tokens": 300}) for i in range(2)
    ]
    for thread in longs:
        thread.start()
    wait_for(
        lambda: metric(workers[home], "axon_worker_running_sequences", model=MODEL) >= 2, timeout_s=10, what="both"
    )
    spilled_before = api.routes("load_spill")
    api.ask(f"{P} {R} spilled")  # its home by the index (P) is busy: it goes to the other worker
    assert api.routes("load_spill") - spilled_before == 1
    assert api.holder(f"{P} {R}", list(workers)) == other
    for thread in longs:
        thread.join(timeout=30)
    # Now each worker holds P, and one of them more: each request goes where its longest prefix is.
    assert cached(api.ask(f"{P} {Q} again")) >= 600 - 16
    assert cached(api.ask(f"{P} {R} again")) >= 600 - 16


def test_an_index_redis_lost_is_written_again_within_seconds(api: Api, workers: dict[str, Service]) -> None:
    document = words("lost")
    api.ask(f"{document} first")
    home = api.holder(document, list(workers))
    for worker_id in workers:
        api.redis.delete(api.names.prefix_index(MODEL, worker_id))  # as a Redis restarted empty
    assert api.holds(home, document) == 0
    # Until the workers write their sets again, requests go by today's rules; then by the index.
    wait_for(lambda: api.holds(home, document) > 0, timeout_s=10, what="the set written again")
    assert cached(api.ask(f"{document} second")) >= 300 - 16


def test_a_dead_workers_documents_cost_one_miss_and_no_request_and_a_new_worker_joins(
    api: Api, workers: dict[str, Service], stack: Stack
) -> None:
    document = words("dies")
    api.ask(f"{document} first")
    dead = api.holder(document, list(workers))
    survivor = next(w for w in workers if w != dead)
    workers[dead].kill()
    # Its heartbeat is still live: the index sends the request to its queue, whence RabbitMQ moves
    # it to the shared queue after the affinity wait, and the survivor answers: a miss, not an error.
    assert cached(api.ask(f"{document} second")) < 300 - 16
    wait_for(lambda: not api.alive(dead), timeout_s=10, what="the dead worker's heartbeat to expire")
    assert cached(api.ask(f"{document} third")) >= 300 - 16  # the survivor holds it now
    assert api.holder(document, [survivor]) == survivor
    stack.start("worker:px-new", env={**WORKER_ENV, "AXON_WORKER_ID": "px-new"})
    wait_for(lambda: api.alive("px-new"), timeout_s=10, what="the new worker's heartbeat")
    fresh = [words(f"fresh{i}x") for i in range(4)]
    for document in fresh:  # new documents spread over both live workers, then stay where they landed
        api.ask(f"{document} first")
    assert "px-new" in {api.holder(document, ["px-new", survivor]) for document in fresh}
    assert all(cached(api.ask(f"{document} second")) >= 300 - 16 for document in fresh)


def test_redis_away_from_a_worker_costs_no_request_and_its_set_is_written_again(
    api: Api, stack: Stack, service_urls: ServiceUrls
) -> None:
    """The worker alone loses Redis for a while (and Redis loses its set meanwhile): the request
    sent then waits and is answered from its cache once Redis is back, and the set is written whole."""
    for service in [s for s in stack.services if s.name.startswith("worker:px-")]:
        service.kill()  # one worker only from here
    proxy = TcpProxy.to(service_urls.redis)
    try:
        env = {**WORKER_ENV, "AXON_WORKER_ID": "px-away", "AXON_REDIS_URL": proxy.proxied(service_urls.redis)}
        worker = stack.start("worker:px-away", env={**env, "AXON_CONNECT_TIMEOUT_S": "1"})
        document = words("away")
        api.ask(f"{document} first")
        assert api.holder(document, ["px-away"]) == "px-away"
        proxy.cut()
        wait_for(
            lambda: httpx.get(f"{worker.url}/ready", timeout=5).status_code == 503, timeout_s=15, what="Redis lost"
        )
        api.redis.delete(api.names.prefix_index(MODEL, "px-away"))
        answers: list[dict] = []
        during = threading.Thread(target=lambda: answers.append(api.ask(f"{document} during")))
        during.start()
        proxy.restore()
        during.join(timeout=60)
        assert answers and cached(answers[0]) >= 300 - 16
        wait_for(lambda: api.holds("px-away", document) > 0, timeout_s=15, what="the set written again")
    finally:
        proxy.close()
