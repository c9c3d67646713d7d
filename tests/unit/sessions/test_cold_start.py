"""A request queued while its model has no live worker (scale to zero): its job says until when its
requester waits and which parameters it uses, and its first chunk is awaited with keep-alives until
then, after which it is 503 `no_worker`."""

import asyncio
import time

import orjson
import pytest
from redis.exceptions import RedisError

from services.sessions import cold_start
from services.sessions.active_request import ActiveRequest, Choice
from services.sessions.catalog import ModelCatalog
from services.sessions.chat.protocol import ResponseBuilder
from services.sessions.cold_start import cold_start_job, first_after_cold_start
from services.sessions.metrics import SessionsMetrics
from services.sessions.relay import Inbox, TokenStream
from shared.errors import Unavailable
from shared.internal_headers import Caller
from shared.openai_requests import RequestLimits, parse_request
from shared.registry import LiveModel, WorkerRegistry
from shared.schemas import Job, TokenChunk
from tests.waiting import until

MODEL = "cold-model"


def _job(*, start_by: float | None, deadline_in_s: float = 300) -> Job:
    return Job(
        job_id="j1",
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        channel="tokens:j1",
        deadline=time.time() + deadline_in_s,
        start_by=start_by,
    )


def _active(job: Job) -> tuple[ActiveRequest, TokenStream]:
    stream = TokenStream(None, job.job_id, job.channel, Inbox())  # type: ignore[arg-type]
    builder = ResponseBuilder(kind="chat", job_id=job.job_id, model=MODEL, include_usage=False, logprobs=False)
    active = ActiveRequest(
        choices=[Choice(0, job)],
        caller=Caller(tenant="t"),
        stream=stream,
        builder=builder,
        started=time.perf_counter(),
        turn=None,
    )
    return active, stream


def _waits(metrics: SessionsMetrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "axon_sessions_cold_start_waits_total", {"model": MODEL, "outcome": outcome}
    )
    return value or 0.0


def _waiting(metrics: SessionsMetrics) -> float:
    return metrics.registry.get_sample_value("axon_sessions_cold_start_waiting", {"model": MODEL}) or 0.0


@pytest.fixture(autouse=True)
def short_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cold_start, "KEEPALIVE_INTERVAL_S", 0.1)


def test_a_cold_start_job_waits_at_most_until_its_deadline_and_carries_the_parameters_it_uses() -> None:
    body = parse_request(
        "chat",
        orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 1, "stop": ["x"]}),
        RequestLimits(),
    )
    before = time.time()
    job = cold_start_job(_job(start_by=None), body, 30)
    assert before + 30 <= (job.start_by or 0) <= time.time() + 30
    assert job.requires == ["seed", "stop"]
    capped = cold_start_job(_job(start_by=None, deadline_in_s=10), body, 30)
    assert capped.start_by == capped.deadline


async def test_the_first_chunk_ends_the_wait_after_keepalives() -> None:
    metrics = SessionsMetrics()
    active, stream = _active(_job(start_by=time.time() + 10))
    beats: list[float] = []

    async def on_wait() -> None:
        beats.append(time.monotonic())

    async def worker_starts() -> float:
        await asyncio.sleep(0.35)
        stream.queue.put_nowait(TokenChunk(seq=0, text="Hi", n_tokens=1).model_dump_json().encode())
        return time.monotonic()

    arrival = asyncio.create_task(worker_starts())
    choice, chunk = await first_after_cold_start(active, active.chunks(), on_wait=on_wait, metrics=metrics)
    arrived_at = await arrival
    assert chunk.text == "Hi" and choice.index == 0
    assert len(beats) >= 2 and all(b < arrived_at for b in beats)  # one per 0.1 s until the chunk
    assert (_waits(metrics, "served"), _waits(metrics, "timed_out"), _waiting(metrics)) == (1, 0, 0)


async def test_no_chunk_by_start_by_is_503_no_worker_with_retry_after() -> None:
    metrics = SessionsMetrics()
    active, _ = _active(_job(start_by=time.time() + 0.25))
    beats = 0

    async def on_wait() -> None:
        nonlocal beats
        beats += 1

    started = time.monotonic()
    with pytest.raises(Unavailable) as refused:
        await first_after_cold_start(active, active.chunks(), on_wait=on_wait, metrics=metrics)
    assert 0.2 <= time.monotonic() - started < 1
    assert (refused.value.status_code, refused.value.code, refused.value.retry_after_s) == (503, "no_worker", 5)
    assert 1 <= beats <= 2  # every 0.1 s, none once the wait is over
    assert (_waits(metrics, "timed_out"), _waiting(metrics)) == (1, 0)


async def test_a_client_that_leaves_while_waiting_is_counted_and_stops_waiting() -> None:
    metrics = SessionsMetrics()
    active, _ = _active(_job(start_by=time.time() + 10))
    waiter = asyncio.create_task(first_after_cold_start(active, active.chunks(), on_wait=None, metrics=metrics))
    await until(lambda: _waiting(metrics) == 1, timeout_s=5, what="the request counted as waiting")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (_waits(metrics, "disconnected"), _waiting(metrics)) == (1, 0)


class _ReadOnlyRegistry(WorkerRegistry):
    """Live models can be read, profiles cannot be written (a Redis that refuses writes)."""

    def __init__(self) -> None:
        self.writes = 0

    async def live_models(self) -> dict[str, LiveModel]:
        return {MODEL: LiveModel(1, 4096)}

    async def aliases(self) -> dict[str, str]:
        return {}

    async def remember_profiles(self, live: dict[str, LiveModel]) -> None:
        self.writes += 1
        raise RedisError("READONLY You can't write against a read only replica.")


async def test_a_profile_that_cannot_be_remembered_fails_no_refresh_and_is_tried_again() -> None:
    registry = _ReadOnlyRegistry()
    catalog = ModelCatalog(registry, cache_ttl_s=0)
    assert (await catalog.live())[MODEL].workers == 1
    assert (await catalog.live())[MODEL].workers == 1
    assert registry.writes == 2
