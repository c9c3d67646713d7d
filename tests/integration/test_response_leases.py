"""Leases on unfinished stored responses against real Redis and PostgreSQL: one process's expired
lease is claimed by another exactly once, renewing reports a finished or taken response, the
first finisher alone stores it, a response whose job never started is taken over and stored
`failed` once its deadline passed, a takeover settles the request's admission (concurrency lease,
token budget) once, starting_after past the end of a running response is refused once its end
is known, and deleting an unfinished one drops its lease and cancels its job."""

import asyncio
import datetime as dt
import time
import uuid

import asyncpg
import orjson
import pytest

from services.sessions.chunk_log import ChunkLog
from services.sessions.completions import CompletionService
from services.sessions.leases import ResponseLeases
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox
from services.sessions.responses.service import (
    Pending,
    ResponseEvents,
    ResponsesService,
    ResponseStore,
    StoredResponse,
    finished_response,
    skeleton_of,
)
from services.sessions.run_on import RunOn
from services.sessions.settings import SessionsSettings
from shared.errors import InvalidRequest
from shared.internal_headers import Caller
from shared.keys import KeyLimits
from shared.names import Names
from shared.ratelimit import RateLimiter, budget_window
from shared.redis_pipe import RedisPipe
from shared.schemas import Message, TokenChunk, Usage

INITIAL = {"object": "response", "status": "queued", "background": True, "output": [], "usage": None}


@pytest.fixture
async def setup(database_url, redis_client, namespace, service_urls):
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    names = Names(f"{namespace}-leases-{uuid.uuid4().hex[:6]}")
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    store = ResponseStore(
        redis_client, pool, Outbox(redis_client, names), namespace=names.namespace, ttl_s=3600, pipe=pipe
    )
    yield names, store
    await redis_client.delete(names.outbox, names.responses_running, names.responses_owners)
    await pool.close()
    await pipe.aclose()


def _leases(redis_client, names: Names, owner: str, lease_s: float = 1.0) -> ResponseLeases:
    return ResponseLeases(redis_client, namespace=names.namespace, instance_id=owner, lease_s=lease_s)


def _service(
    store: ResponseStore, redis_client, names: Names, completions: CompletionService | None = None
) -> ResponsesService:
    """The service's replay and takeover (they need neither a model nor a session; `completions`
    only to settle a request)."""
    return ResponsesService(
        settings=None,  # type: ignore[arg-type]
        completions=completions,  # type: ignore[arg-type]
        catalog=None,  # type: ignore[arg-type]
        sessions=None,  # type: ignore[arg-type]
        store=store,
        chunk_log=ChunkLog(redis_client, names, block_s=0.5),
        run_on=RunOn(_leases(redis_client, names, "taker")),
    )


def _unfinished(response_id: str, *, deadline: float) -> StoredResponse:
    return StoredResponse(
        tenant="t",
        response={**INITIAL, "id": response_id},
        input_items=[],
        context=[Message(role="user", content="hi")],
        job_id=str(uuid.uuid4()),
        pending=Pending(history=0, deadline=deadline),
    )


async def test_an_expired_lease_is_claimed_once_and_the_first_finisher_alone_stores(setup, redis_client) -> None:
    names, store = setup
    dead, alive, other = (_leases(redis_client, names, owner) for owner in ("dead", "alive", "other"))
    response_id = "resp_" + uuid.uuid4().hex
    stored = _unfinished(response_id, deadline=time.time() + 60)
    await store.open(response_id, stored, owner="dead", lease_expiry_ms=int(time.time() * 1000) - 1)
    claimed = await asyncio.gather(alive._claim_expired(), other._claim_expired())
    assert sorted(claimed, key=len) == [[], [response_id]]  # one of the two, once
    assert await alive._claim_expired() == [] and await other._claim_expired() == []  # renewed by the claim

    winner = alive if claimed[0] else other
    waiting = asyncio.Event()
    winner.hold(response_id, waiting.wait())
    dead.hold(response_id, waiting.wait())
    await winner._renew_held()
    await dead._renew_held()  # it lost the lease: its relay is stopped, the response is not "finished"
    await asyncio.sleep(0.01)  # the cancelled task ends
    assert not dead.holding(response_id) and not dead.abandoned(response_id) and winner.holding(response_id)

    done = stored.model_copy(update={"response": {**stored.response, "status": "completed"}, "pending": None})
    assert await store.finish(response_id, done)
    assert not await store.finish(response_id, done.model_copy(update={"last_seq": 5}))  # a late finisher
    again = await store.get("t", response_id)
    assert again is not None and again.pending is None and again.last_seq is None
    assert await redis_client.xlen(names.outbox) == 1  # written behind once
    await winner._renew_held()  # finished elsewhere: its relay is cancelled as abandoned
    await asyncio.sleep(0.01)  # the cancelled task ends
    assert not winner.holding(response_id)


async def test_a_response_whose_job_never_started_fails_at_its_deadline(setup, redis_client) -> None:
    names, store = setup
    service = _service(store, redis_client, names)
    response_id = "resp_" + uuid.uuid4().hex
    await store.open(response_id, _unfinished(response_id, deadline=time.time() - 10), owner="dead", lease_expiry_ms=0)
    started = time.monotonic()
    await service.take_over(response_id)
    assert time.monotonic() - started < 10  # the deadline passed: only the grace is waited
    stored = await store.get("t", response_id)
    assert stored is not None and stored.pending is None and stored.last_seq == -1
    assert stored.response["status"] == "failed"
    assert "did not start before its deadline" in stored.response["error"]["message"]
    assert finished_response(INITIAL, status="failed", output=[], usage=None)["usage"]["total_tokens"] == 0


async def test_deleting_an_unfinished_response_drops_its_lease_and_cancels_its_job(setup, redis_client) -> None:
    names, store = setup
    response_id = "resp_" + uuid.uuid4().hex
    stored = _unfinished(response_id, deadline=time.time() + 60)
    await store.open(response_id, stored, owner="o", lease_expiry_ms=int(time.time() * 1000) + 60_000)
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(names.cancel_channel)
    try:
        assert await store.delete("t", response_id)
        notices = []
        async with asyncio.timeout(5):
            while not notices:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                if message is not None:
                    notices.append(message["data"].decode())
    finally:
        await pubsub.aclose()
    assert notices == [stored.job_id]
    assert await redis_client.zscore(names.responses_running, response_id) is None
    assert await store.get("t", response_id) is None
    assert not await store.finish(response_id, stored)  # its relay, finishing later, stores nothing


async def test_a_resume_whose_log_is_complete_ends_once_the_response_is_stored(setup, redis_client) -> None:
    names, store = setup
    service = _service(store, redis_client, names)
    response_id = "resp_" + uuid.uuid4().hex
    stored = _unfinished(response_id, deadline=time.time() + 3600)
    await store.open(response_id, stored, owner="o", lease_expiry_ms=int(time.time() * 1000) + 60_000)
    chunks = [TokenChunk(seq=0, text="Hello"), TokenChunk(seq=1, text=" there", finish_reason="stop", usage=Usage())]
    log_key = names.chunk_log(stored.job_id or "")
    for chunk in chunks:  # as the worker logs them: the answer is complete, its relay has not stored it yet
        await redis_client.xadd(log_key, {"c": chunk.model_dump_json(exclude_none=True)}, id=f"0-{chunk.seq + 1}")
    events = await service.replays.replay("t", response_id, starting_after=3)

    async def store_it_soon() -> None:
        await asyncio.sleep(0.3)
        done = ResponseEvents(skeleton_of(stored.response), quiet=True)
        for chunk in chunks:
            done.chunk(chunk)
        response = finished_response(stored.response, status="completed", output=done.output("completed"), usage=None)
        assert await store.finish(response_id, stored.model_copy(update={"response": response, "pending": None}))

    started = time.monotonic()
    storing = asyncio.create_task(store_it_soon())
    pieces = [piece async for piece in events]
    await storing
    await redis_client.delete(log_key)
    assert time.monotonic() - started < 3  # not the job's deadline (an hour) + 5 s
    text = b"".join(pieces).decode()
    assert text.startswith("event: response.output_text.delta\nid: 4\n")  # after starting_after
    assert text.rstrip().split("\n")[-3] == "event: response.completed"


async def test_a_takeover_settles_the_requests_admission_once(setup, redis_client, service_urls) -> None:
    """The relay that handed the response over (its process died) settled nothing: the takeover
    that stores it releases the key's concurrency lease and settles its budget reservation to the
    logged usage, and only that finisher does."""
    names, store = setup
    pipe = RedisPipe(service_urls.redis, timeout_s=5)
    limiter = RateLimiter(pipe, names)
    settings = SessionsSettings(namespace=names.namespace)
    completions = CompletionService(
        settings=settings,
        catalog=None,  # type: ignore[arg-type]
        relay=None,  # type: ignore[arg-type]
        publisher=None,  # type: ignore[arg-type]
        pipe=pipe,
        outbox=None,  # type: ignore[arg-type]
        limiter=limiter,
        turns=None,  # type: ignore[arg-type]
        metrics=SessionsMetrics(),
    )
    service = _service(store, redis_client, names, completions)
    key_id, period = "k" + uuid.uuid4().hex[:8], budget_window("day", dt.datetime.now(dt.UTC))[0]
    limits = KeyLimits(max_concurrent=1, token_budget=100, budget_period="day")

    async def admit(reserve: int):
        return await limiter.check(
            key_id, limits, tokens=reserve, lease_id=uuid.uuid4().hex[:16], lease_ttl_s=60, period_id=period
        )

    response_id = "resp_" + uuid.uuid4().hex
    stored = _unfinished(response_id, deadline=time.time() + 60)
    assert stored.pending is not None
    log_key = names.chunk_log(stored.job_id or "")
    try:
        admitted = await admit(60)
        assert admitted.allowed and admitted.reservation is not None
        assert (await admit(1)).denied == "concurrent"
        stored.pending.caller = Caller(
            tenant="t", key_id=key_id, lease_id=admitted.lease_id, budget=admitted.reservation
        )
        await store.open(response_id, stored, owner="dead", lease_expiry_ms=0)
        final = TokenChunk(seq=0, text="Hi", finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=3))
        await redis_client.xadd(log_key, {"c": final.model_dump_json(exclude_none=True)}, id="0-1")
        taken = await service.take_over(response_id)
        assert taken is not None and taken["status"] == "completed"
        assert await service.take_over(response_id) is None  # finished: nothing to settle again
        again = await admit(1)
        assert again.allowed  # the concurrency lease was released
        assert again.budget_used == 8 + 1  # the 60 reserved were settled to the 8 used, once
    finally:
        limiter_keys = [names.rate_limit(kind, key_id) for kind in ("rpm", "tpm", "conc")]
        await redis_client.delete(log_key, names.rate_limit("budget", f"{key_id}:{period}"), *limiter_keys)
        await pipe.aclose()


async def test_starting_after_past_the_end_of_a_running_response(setup, redis_client) -> None:
    """Past the end of a running response: 400 once its log holds its final chunk (as for a
    finished one), and an `error` event once it ends, when its end was not known yet."""
    names, store = setup
    service = _service(store, redis_client, names)
    response_id = "resp_" + uuid.uuid4().hex
    stored = _unfinished(response_id, deadline=time.time() + 3600)
    await store.open(response_id, stored, owner="o", lease_expiry_ms=int(time.time() * 1000) + 60_000)
    chunks = [TokenChunk(seq=0, text="Hello"), TokenChunk(seq=1, text=" there", finish_reason="stop", usage=Usage())]
    log_key = names.chunk_log(stored.job_id or "")

    async def log(chunk: TokenChunk) -> None:
        await redis_client.xadd(log_key, {"c": chunk.model_dump_json(exclude_none=True)}, id=f"0-{chunk.seq + 1}")

    async def end_it_soon() -> None:
        await asyncio.sleep(0.3)
        await log(chunks[1])
        done = ResponseEvents(skeleton_of(stored.response), quiet=True)
        for chunk in chunks:
            done.chunk(chunk)
        response = finished_response(stored.response, status="completed", output=done.output("completed"), usage=None)
        assert await store.finish(response_id, stored.model_copy(update={"response": response, "pending": None}))

    try:
        await log(chunks[0])  # 2 opening events, 3 of the first text; its end is not known yet
        events = await service.replays.replay("t", response_id, starting_after=50)
        ending = asyncio.create_task(end_it_soon())
        pieces = [piece async for piece in events]
        await ending
        assert len(pieces) == 1 and pieces[0].startswith(b"event: error\ndata: ")
        error = orjson.loads(pieces[0].split(b"data: ", 1)[1])
        # 2 opening, 3 of the first text, 1 delta, 3 closing the message, response.completed: 0..9
        assert error["param"] == "starting_after" and "its last event is 9" in error["message"]
        await store.open(response_id, stored, owner="o", lease_expiry_ms=int(time.time() * 1000) + 60_000)
        for after in (9, 50):  # unfinished again, its log complete: its end is known
            with pytest.raises(InvalidRequest, match="its last event is 9"):
                await service.replays.replay("t", response_id, starting_after=after)
    finally:
        await redis_client.delete(log_key)


async def test_a_followed_response_sends_keep_alives_while_nothing_comes(setup, redis_client) -> None:
    """A stream following a running response whose job sends nothing (queued, a worker starting)
    sends an SSE comment every `keepalive_s`, so idle timeouts on the way do not cut it."""
    names, store = setup
    service = _service(store, redis_client, names)
    service.replays.keepalive_s = 0.1
    response_id = "resp_" + uuid.uuid4().hex
    stored = _unfinished(response_id, deadline=time.time() + 3600)
    await store.open(response_id, stored, owner="o", lease_expiry_ms=int(time.time() * 1000) + 60_000)
    log_key = names.chunk_log(stored.job_id or "")
    final = TokenChunk(seq=0, text="Hi", finish_reason="stop", usage=Usage())
    events = await service.replays.replay("t", response_id, starting_after=None)
    try:
        assert (await anext(events)).startswith(b"event: response.created\n")
        async with asyncio.timeout(2):
            assert await anext(events) == b": keep-alive\n\n"
            assert await anext(events) == b": keep-alive\n\n"
        await redis_client.xadd(log_key, {"c": final.model_dump_json(exclude_none=True)}, id="0-1")
        async with asyncio.timeout(2):
            piece = await anext(events)
            while piece == b": keep-alive\n\n":
                piece = await anext(events)
        assert piece.startswith(b"event: response.output_item.added\n")
    finally:
        await events.aclose()
        await redis_client.delete(log_key)
