"""Fair share between tenants on a sim worker of 4 sequences (10 ms a token), through the official
`openai` client: a quiet tenant's first token beside another tenant's burst, token shares of
backlogged tenants by weight whatever their answers' lengths, a lone tenant's whole capacity, a
newly active tenant lifted (no credit for idle time), and batch lines shared between tenants."""

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis
from openai import AsyncOpenAI, OpenAI

from services.cli.launcher import Service
from shared.keys import KeyLimits
from shared.names import Names
from tests.conftest import create_key
from tests.e2e.stack import ADMIN_TOKEN, Stack
from tests.e2e.test_batches import _jsonl, _line, upload, wait_status
from tests.e2e.test_workers import client_for, metric, sim_worker, wait_listed
from tests.waiting import until

# `alone` (make test runs it with no other test beside it): it times first tokens beside a burst.
pytestmark = [pytest.mark.e2e, pytest.mark.alone]

MODEL = "fair-sim"
SEQS = 4
LIMITS = KeyLimits(rpm=1_000_000, tpm=100_000_000, max_concurrent=10_000)


@pytest.fixture(scope="module")
def worker(stack: Stack) -> Iterator[Service]:
    worker = sim_worker(stack, "fair", MODEL, AXON_SIM_MAX_SEQS=str(SEQS), AXON_SIM_TTFT_MS="20", AXON_SIM_ITL_MS="10")
    try:
        yield worker
    finally:
        worker.stop(timeout_s=15)
        stack.services.remove(worker)


def tenant_key(database_url: str, tenant: str) -> str:
    return asyncio.run(create_key(database_url, name=tenant, limits=LIMITS, tenant=tenant))


def set_weight(gateway: Service, tenant: str, weight: float) -> None:
    response = httpx.put(
        f"{gateway.url}/admin/tenants/{tenant}",
        json={"weight": weight},
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    assert response.status_code == 200, response.text


def aclient(gateway: Service, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


async def ask(client: AsyncOpenAI, max_tokens: int) -> tuple[float, int]:
    """One streamed answer: its time to first token (s) and its tokens."""
    started = time.perf_counter()
    ttft, tokens = 0.0, 0
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "go"}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if not ttft and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return ttft, tokens


async def keep_busy(
    client: AsyncOpenAI,
    *,
    streams: int,
    max_tokens: int,
    until: float,
    tokens: list[int],
    stop: asyncio.Event | None = None,
) -> None:
    """`streams` answers of `max_tokens` in flight until `until` (monotonic) or `stop` is set;
    their tokens added to `tokens` as each ends (those ended after `until` too)."""

    async def one() -> None:
        while time.monotonic() < until and not (stop is not None and stop.is_set()):
            _ttft, n = await ask(client, max_tokens)
            tokens.append(n)

    await asyncio.gather(*(one() for _ in range(streams)))


def shares(gateway: Service, a: str, b: str, *, a_tokens: int, b_tokens: int, seconds: float) -> float:
    """Two tenants each keeping 2 x the worker's sequences in flight for `seconds`: `a`'s share of
    the tokens generated after a warm-up."""

    async def run() -> float:
        counted: dict[str, list[int]] = {a: [], b: []}
        warm = time.monotonic() + 1.5
        until = warm + seconds
        clients = {a: aclient(gateway, a_key_of[a]), b: aclient(gateway, a_key_of[b])}
        warmup = [
            asyncio.create_task(keep_busy(clients[t], streams=2 * SEQS, max_tokens=n, until=warm, tokens=[]))
            for t, n in ((a, a_tokens), (b, b_tokens))
        ]
        await asyncio.gather(*warmup)
        await asyncio.gather(
            keep_busy(clients[a], streams=2 * SEQS, max_tokens=a_tokens, until=until, tokens=counted[a]),
            keep_busy(clients[b], streams=2 * SEQS, max_tokens=b_tokens, until=until, tokens=counted[b]),
        )
        return sum(counted[a]) / (sum(counted[a]) + sum(counted[b]))

    return asyncio.run(run())


a_key_of: dict[str, str] = {}


@pytest.fixture(scope="module")
def tenants(worker: Service, gateway: Service, database_url: str) -> dict[str, str]:
    for tenant in ("fair-quiet", "fair-noisy", "fair-long", "fair-short", "fair-one", "fair-three", "fair-late"):
        a_key_of[tenant] = tenant_key(database_url, tenant)
    wait_listed(client_for(gateway, a_key_of["fair-quiet"]), MODEL)
    return a_key_of


def test_a_quiet_tenants_first_token_does_not_wait_behind_another_tenants_burst(
    gateway: Service, tenants: dict[str, str]
) -> None:
    async def run() -> tuple[float, float]:
        quiet = aclient(gateway, tenants["fair-quiet"])
        alone = [(await ask(quiet, 4))[0] for _ in range(5)]
        until = time.monotonic() + 6
        burst = asyncio.create_task(
            keep_busy(aclient(gateway, tenants["fair-noisy"]), streams=4 * SEQS, max_tokens=64, until=until, tokens=[])
        )
        await asyncio.sleep(1.0)  # the burst's backlog is queued
        beside = []
        while time.monotonic() < until - 0.5:
            beside.append((await ask(quiet, 4))[0])
        await burst
        return statistics.median(alone), statistics.median(beside)

    alone, beside = asyncio.run(run())
    # First in, first out, the quiet request would wait behind 12 answers of 64 tokens (about 2 s);
    # its share takes the next free sequence: about a quarter of an answer's 0.64 s at most.
    assert beside < alone + 0.4, (alone, beside)


def test_backlogged_tenants_share_tokens_not_requests(gateway: Service, tenants: dict[str, str]) -> None:
    # 64-token answers against 16-token answers: by requests the long tenant would take about 4/5.
    long_share = shares(gateway, "fair-long", "fair-short", a_tokens=64, b_tokens=16, seconds=5)
    assert 0.35 <= long_share <= 0.65, long_share


def test_each_tenants_wait_and_tokens_are_metrics(worker: Service, tenants: dict[str, str]) -> None:
    # After the tests above: the worker counted each tenant's tokens and waits.
    for tenant in ("fair-long", "fair-short"):
        for kind in ("output", "prompt"):
            tokens = metric(
                worker, "axon_worker_tenant_tokens_total", band="interactive", kind=kind, model=MODEL, tenant=tenant
            )
            assert tokens > 0, (tenant, kind)
        waits = metric(
            worker, "axon_worker_tenant_queue_wait_seconds_count", band="interactive", model=MODEL, tenant=tenant
        )
        assert waits > 0
        wait_s = metric(
            worker, "axon_worker_tenant_queue_wait_seconds_sum", band="interactive", model=MODEL, tenant=tenant
        )
        assert 0 < wait_s / waits < 5  # a few answers' time at most, on the same clock


def test_tenants_share_by_weight(gateway: Service, tenants: dict[str, str]) -> None:
    set_weight(gateway, "fair-three", 3)
    three_share = shares(gateway, "fair-three", "fair-one", a_tokens=16, b_tokens=16, seconds=5)
    assert 0.65 <= three_share <= 0.85, three_share


def test_a_lone_tenant_gets_every_sequence_and_a_late_one_no_credit_for_idle_time(
    gateway: Service, worker: Service, tenants: dict[str, str], stack: Stack
) -> None:
    fair = redis_served(stack)

    async def run() -> None:
        stop = asyncio.Event()
        one = aclient(gateway, tenants["fair-one"])
        busy = asyncio.create_task(
            keep_busy(one, streams=2 * SEQS, max_tokens=32, until=math.inf, tokens=[], stop=stop)
        )
        try:
            await asyncio.sleep(1.5)

            async def every_sequence() -> bool:  # a sample may fall between an answer and its stream's next
                return await asyncio.to_thread(metric, worker, "axon_worker_running_sequences", model=MODEL) == SEQS

            await until(every_sequence, timeout_s=5, what="the lone tenant in every sequence")
            # Idle until now, the late tenant starts level with the one served all along.
            before = fair().get("fair-one", 0.0)
            await ask(aclient(gateway, tenants["fair-late"]), 4)
            assert fair()["fair-late"] >= before * 0.9 > 0
        finally:
            stop.set()
            await busy

    asyncio.run(run())


def redis_served(stack: Stack) -> Callable[[], dict[str, float]]:
    """Reads the model's interactive served counters (weighted tokens) per tenant."""
    client = redis.Redis.from_url(stack.redis_url)
    key = Names(stack.namespace).fair(MODEL, "interactive", "served")

    def served() -> dict[str, float]:
        return {k.decode(): float(v) for k, v in client.hgetall(key).items()}

    return served


def test_a_small_batch_is_not_held_back_by_another_tenants_big_one(gateway: Service, tenants: dict[str, str]) -> None:
    big_client = OpenAI(base_url=f"{gateway.url}/v1", api_key=tenants["fair-noisy"], max_retries=0, timeout=30)
    small_client = OpenAI(base_url=f"{gateway.url}/v1", api_key=tenants["fair-quiet"], max_retries=0, timeout=30)
    big = big_client.batches.create(
        input_file_id=upload(big_client, _jsonl([_line(f"big-{i}", model=MODEL, max_tokens=64) for i in range(60)])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    time.sleep(1.0)  # the big batch fills the worker's free sequences and has lines waiting
    small = small_client.batches.create(
        input_file_id=upload(small_client, _jsonl([_line(f"small-{i}", model=MODEL, max_tokens=8) for i in range(4)])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    done = wait_status(small_client, small.id, {"completed", "failed"}, timeout_s=60)
    assert done.status == "completed", done.errors
    assert done.request_counts is not None and done.request_counts.completed == 4
    # First in, first out, the 4 lines would wait behind about 55 lines of 0.64 s on 3 sequences.
    assert big_client.batches.retrieve(big.id).status == "in_progress"
    big_client.batches.cancel(big.id)
