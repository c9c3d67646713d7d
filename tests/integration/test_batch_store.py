"""Batches and their lines on a real PostgreSQL: each line answered and counted once whoever
answers it, statuses moved only from the statuses named, a failed validation storing nothing,
a key's batch queue limit, an ended batch's lines deleted, its row after the retention, and each
deployment (namespace) seeing only its own batches; Anthropic's message batches stored with their
lines or not at all, their never-run lines counted apart, paged as Anthropic pages them, and
deleted only once ended."""

import asyncio
import dataclasses
import datetime as dt
import secrets
from collections.abc import AsyncIterator

import asyncpg
import orjson
import pytest

from services.sessions.batches.messages import new_message_batch_id
from services.sessions.batches.protocol import new_batch_id
from services.sessions.batches.store import MESSAGES_ENDPOINT, BatchRecord, BatchStore, QueueFull, line_request_id
from services.sessions.batches.validation import BatchLine


@pytest.fixture
async def store(database_url) -> AsyncIterator[BatchStore]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=6)
    yield BatchStore(pool, namespace="axon")
    await pool.close()


async def _batch(store: BatchStore, *, key_id: str = "key_store", status: str = "validating") -> str:
    now = dt.datetime.now(dt.UTC)
    batch_id = new_batch_id()
    await store.create(
        BatchRecord(
            id=batch_id,
            tenant="store-tests",
            key_id=key_id,
            endpoint="/v1/chat/completions",
            input_file_id="file-x",
            completion_window="24h",
            status=status,
            metadata=None,
            errors=None,
            output_file_id=None,
            error_file_id=None,
            total=0,
            completed=0,
            failed=0,
            created_at=now,
            expires_at=now + dt.timedelta(days=1),
        )
    )
    return batch_id


async def _lines(count: int, *, tokens: int = 10, fail_at: int | None = None) -> AsyncIterator[BatchLine]:
    for number in range(1, count + 1):
        if number == fail_at:
            raise ValueError("the file broke a rule")
        yield BatchLine(number, f"c-{number}", "m", '{"model": "m"}', tokens)


async def test_each_line_is_answered_and_counted_once_whoever_answers(store: BatchStore) -> None:
    batch_id = await _batch(store)
    assert await store.validated(batch_id, _lines(3), key_id=None, queue_tokens=0) == 3
    answers = [{"id": line_request_id(batch_id, 2), "custom_id": "c-2", "n": n} for n in range(5)]
    # Five answers of line 2 at once (an owner that lost its lease and the one that took over).
    done = await asyncio.gather(*(store.answer(batch_id, 2, ok=True, result=a) for a in answers))
    assert sorted(done) == [False, False, False, False, True]
    assert not await store.answer(batch_id, 2, ok=False, result={"late": True})
    await store.answer(batch_id, 3, ok=False, result={"custom_id": "c-3"})
    record = await store.load(batch_id)
    assert record is not None and (record.total, record.completed, record.failed) == (3, 1, 1)
    assert [line.line for line in await store.unanswered(batch_id, after_line=0, limit=10)] == [1]
    assert await store.answer_rest(batch_id, code="batch_expired", message="late") == 1
    assert await store.answer_rest(batch_id, code="batch_expired", message="late") == 0
    output = b"".join([piece async for piece in store.results(batch_id, ok=True)])
    [line] = [orjson.loads(raw) for raw in output.splitlines()]
    assert line["custom_id"] == "c-2" and line["n"] in range(5)
    errors = [orjson.loads(raw) for raw in b"".join([p async for p in store.results(batch_id, ok=False)]).splitlines()]
    assert [e["custom_id"] for e in errors] == ["c-1", "c-3"]
    assert errors[0]["id"] == line_request_id(batch_id, 1)  # the same id from SQL as from Python
    record = await store.load(batch_id)
    assert record is not None and (record.completed, record.failed) == (1, 2)


async def test_a_status_moves_only_from_the_statuses_named(store: BatchStore) -> None:
    batch_id = await _batch(store, status="in_progress")
    assert await store.transition(batch_id, "finalizing", from_=("validating",)) is None
    moved = await store.transition(batch_id, "cancelling", from_=("validating", "in_progress"))
    assert moved is not None and moved.status == "cancelling" and moved.cancelling_at is not None
    assert await store.transition(batch_id, "finalizing", from_=("in_progress",)) is None


async def test_a_validation_that_fails_stores_no_line_and_a_retry_replaces_them(store: BatchStore) -> None:
    batch_id = await _batch(store)
    with pytest.raises(ValueError, match="broke a rule"):
        await store.validated(batch_id, _lines(2500, fail_at=2400), key_id=None, queue_tokens=0)
    assert await store.unanswered(batch_id, after_line=0, limit=1) == []
    # Stored in COPYs of 1,000 lines, each while the next lines are read: every line once.
    assert await store.validated(batch_id, _lines(2500), key_id=None, queue_tokens=0) == 2500
    stored = await store.unanswered(batch_id, after_line=0, limit=3000)
    assert [line.line for line in stored] == list(range(1, 2501))
    assert await store.validated(batch_id, _lines(4), key_id=None, queue_tokens=0) == 4
    assert await store.validated(batch_id, _lines(2), key_id=None, queue_tokens=0) == 2  # a new owner's
    assert len(await store.unanswered(batch_id, after_line=0, limit=10)) == 2


async def test_the_batch_queue_limit_counts_a_keys_unanswered_lines_per_model(store: BatchStore) -> None:
    key = "key_queue_store"
    first = await _batch(store, key_id=key)
    await store.validated(first, _lines(3, tokens=100), key_id=key, queue_tokens=300)
    await store.transition(first, "in_progress", from_=("validating",))
    assert await store.queue_full(key, 300) is not None
    second = await _batch(store, key_id=key)
    with pytest.raises(QueueFull) as full:
        await store.validated(second, _lines(1, tokens=1), key_id=key, queue_tokens=300)
    assert (full.value.model, full.value.tokens) == ("m", 301)
    await store.answer(first, 1, ok=True, result={})
    assert await store.queue_full(key, 300) is None
    assert await store.validated(second, _lines(1, tokens=100), key_id=key, queue_tokens=300) == 1


async def _sql(database_url: str, query: str, *args: object) -> object:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


async def _line_count(database_url: str, batch_id: str) -> int:
    return int(str(await _sql(database_url, "SELECT count(*) FROM batch_lines WHERE batch_id = $1", batch_id)))


async def test_an_ended_batchs_lines_are_deleted_and_its_row_after_the_retention(
    store: BatchStore, database_url: str
) -> None:
    running = await _batch(store)
    ended = await _batch(store)
    for batch_id in (running, ended):
        assert await store.validated(batch_id, _lines(3), key_id=None, queue_tokens=0) == 3
        assert await store.transition(batch_id, "in_progress", from_=("validating",)) is not None
    assert await store.answer_rest(ended, code="batch_cancelled", message="cancelled") == 3
    # Lines of a batch still running are kept.
    assert await store.forget_lines(running) == 0 and await _line_count(database_url, running) == 3
    assert await store.transition(ended, "cancelled", from_=("in_progress",)) is not None
    # An owner that died before forgetting them: the sweep does; the rows stay within the retention.
    assert await store.sweep(retention_days=30) >= 1
    assert await _line_count(database_url, ended) == 0 and await _line_count(database_url, running) == 3
    assert await store.forget_lines(ended) == 0
    record = await store.load(ended)
    assert record is not None and (record.total, record.failed, record.status) == (3, 3, "cancelled")

    # Past the retention (created 31 days ago): the ended batch's row goes, the running one stays.
    await _sql(
        database_url,
        "UPDATE batches SET created_at = now() - interval '31 days' WHERE id = ANY($1::text[])",
        [running, ended],
    )
    while await store.sweep(retention_days=30):
        pass
    assert await store.load(ended) is None
    assert await store.load(running) is not None and await _line_count(database_url, running) == 3


async def test_a_deployment_sees_leases_lists_and_sweeps_only_its_own_batches(database_url) -> None:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=6)
    try:
        ours = BatchStore(pool, namespace="ours-" + secrets.token_hex(4))
        theirs = BatchStore(pool, namespace="theirs-" + secrets.token_hex(4))
        mine, other = await _batch(ours), await _batch(theirs)
        for store, batch_id in ((ours, mine), (theirs, other)):
            await store.validated(batch_id, _lines(2), key_id="key_ns", queue_tokens=0)
            await store.transition(batch_id, "in_progress", from_=("validating",))
        assert await ours.unfinished() == [mine] and await theirs.unfinished() == [other]
        assert await ours.load(other) is None and await ours.get("store-tests", other) is None
        assert [r.id for r in (await ours.page("store-tests", after=None, limit=100))[0]] == [mine]
        assert [r.id for r in await ours.recent(tenant=None, limit=100)] == [mine]
        # Another deployment's batch can be neither moved nor have its lines forgotten from here.
        assert await ours.transition(other, "cancelling", from_=("in_progress",)) is None
        assert await theirs.transition(other, "failed", from_=("in_progress",)) is not None
        while await ours.sweep(retention_days=0):
            pass
        assert await pool.fetchval("SELECT count(*) FROM batch_lines WHERE batch_id = $1", other) == 2
        assert await ours.forget_lines(other) == 0
        assert [model for model, _, _ in await ours.waiting()] == ["m"]
        assert await theirs.waiting() == []
        assert await theirs.forget_lines(other) == 2
    finally:
        await pool.close()


async def test_an_answer_holding_u0000_is_stored_with_u_fffd_in_its_place(store: BatchStore) -> None:
    batch_id = await _batch(store)
    await store.validated(batch_id, _lines(1), key_id=None, queue_tokens=0)
    assert await store.answer(batch_id, 1, ok=False, result={"custom_id": "c-1", "error": {"message": "a\x00b"}})
    [raw] = b"".join([piece async for piece in store.results(batch_id, ok=False)]).splitlines()
    assert orjson.loads(raw)["error"]["message"] == "a\ufffdb"


def _message_batch(*, tenant: str = "message-store-tests", lines: int = 0) -> BatchRecord:
    now = dt.datetime.now(dt.UTC)
    return BatchRecord(
        id=new_message_batch_id(),
        tenant=tenant,
        key_id="key_messages",
        endpoint=MESSAGES_ENDPOINT,
        input_file_id=None,
        completion_window="24h",
        status="in_progress",
        metadata=None,
        errors=None,
        output_file_id=None,
        error_file_id=None,
        total=lines,
        completed=0,
        failed=0,
        created_at=now,
        expires_at=now + dt.timedelta(days=1),
        in_progress_at=now,
    )


def _batch_lines(count: int, *, tokens: int = 10) -> list[BatchLine]:
    return [BatchLine(n, f"c-{n}", "m", '{"model": "m"}', tokens) for n in range(1, count + 1)]


async def test_a_message_batch_is_stored_with_its_lines_or_not_at_all(store: BatchStore) -> None:
    record = _message_batch(lines=2500)
    await store.create_filled(record, _batch_lines(2500), queue_tokens=0)
    stored = await store.load(record.id)
    assert stored is not None and (stored.status, stored.total, stored.input_file_id) == ("in_progress", 2500, None)
    assert stored.in_progress_at is not None
    assert len(await store.unanswered(record.id, after_line=0, limit=3000)) == 2500

    # Past its key's batch queue limit: neither the batch nor a line of it is kept.
    over = dataclasses.replace(_message_batch(lines=3), key_id="key_messages_full")
    with pytest.raises(QueueFull):
        await store.create_filled(over, _batch_lines(3, tokens=100), queue_tokens=299)
    assert await store.load(over.id) is None


async def test_a_message_batchs_unrun_lines_are_canceled_results_counted_apart(store: BatchStore) -> None:
    record = _message_batch(lines=3)
    await store.create_filled(record, _batch_lines(3), queue_tokens=0)
    succeeded = {"custom_id": "c-1", "result": {"type": "succeeded", "message": {"id": "msg_1"}}}
    assert await store.answer(record.id, 1, ok=True, result=succeeded)
    errored = {"custom_id": "c-2", "result": {"type": "errored", "error": {"type": "error"}}}
    assert await store.answer(record.id, 2, ok=False, result=errored)
    assert await store.answer_rest_as_messages(record.id, result_type="canceled") == 1
    assert await store.answer_rest_as_messages(record.id, result_type="canceled") == 0
    stored = await store.load(record.id)
    assert stored is not None and (stored.completed, stored.failed, stored.unrun) == (1, 2, 1)
    # Every answered line, in line order: the one results file.
    results = [orjson.loads(raw) for raw in b"".join([p async for p in store.results(record.id, ok=None)]).splitlines()]
    assert results == [succeeded, errored, {"custom_id": "c-3", "result": {"type": "canceled"}}]


async def test_message_batches_are_paged_as_anthropic_pages_them_apart_from_openais(store: BatchStore) -> None:
    tenant = "pages-" + secrets.token_hex(4)
    records = []
    for _ in range(5):
        record = _message_batch(tenant=tenant)
        await store.create_filled(record, [], queue_tokens=0)
        records.append(record.id)
    newest_first = records[::-1]
    # An OpenAI batch of the same tenant is in neither list of the other's.
    openai_batch = dataclasses.replace(_message_batch(tenant=tenant), id=new_batch_id(), endpoint="/v1/completions")
    await store.create(openai_batch)
    assert [r.id for r in (await store.page(tenant, after=None, limit=10))[0]] == [openai_batch.id]

    async def ids(**cursor: str | None) -> tuple[list[str], bool]:
        page, more = await store.message_page(tenant, limit=2, **{"after_id": None, "before_id": None, **cursor})
        return [r.id for r in page], more

    assert await ids() == (newest_first[:2], True)
    assert await ids(after_id=newest_first[1]) == (newest_first[2:4], True)
    assert await ids(after_id=newest_first[3]) == (newest_first[4:], False)
    # Towards the newer: the two nearest the cursor, still newest first.
    assert await ids(before_id=newest_first[4]) == (newest_first[2:4], True)
    assert await ids(before_id=newest_first[2]) == (newest_first[:2], False)
    assert await ids(after_id=newest_first[0], before_id=newest_first[3]) == (newest_first[1:3], False)
    assert await ids(after_id=new_message_batch_id()) == ([], False)


async def test_only_an_ended_batch_is_deleted_with_its_lines(store: BatchStore, database_url: str) -> None:
    record = _message_batch(lines=2)
    await store.create_filled(record, _batch_lines(2), queue_tokens=0)
    assert await store.delete_ended(record.tenant, record.id) is None
    await store.transition(record.id, "cancelling", from_=("in_progress",))
    await store.answer_rest_as_messages(record.id, result_type="canceled")
    await store.set_files(record.id, output_file_id="file-results", error_file_id=None)
    await store.transition(record.id, "cancelled", from_=("cancelling",))
    assert await store.delete_ended("another-tenant", record.id) is None
    deleted = await store.delete_ended(record.tenant, record.id)
    assert deleted is not None and deleted.output_file_id == "file-results"
    assert await store.load(record.id) is None and await _line_count(database_url, record.id) == 0
