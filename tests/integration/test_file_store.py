"""The file store against a real PostgreSQL: bytes in and out in pieces and in order, by tenant,
nothing left of an upload that failed (too large, empty, the client gone), pages of the list,
deletion and the sweep of expired files and abandoned uploads, each deployment (namespace) seeing
and sweeping only its own files."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from services.sessions.files.store import (
    DatabaseFileStore,
    EmptyFile,
    FileGone,
    FileTooLarge,
    PostgresContent,
)


@pytest.fixture
async def pool(database_url):
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.fixture
def content(pool):
    content = PostgresContent(pool)
    content.piece_bytes = 10  # many pieces from a few bytes
    return content


@pytest.fixture
def store(pool, content):
    return DatabaseFileStore(pool, content, namespace="axon")


@pytest.fixture
def tenant():
    return f"files-{uuid.uuid4().hex[:8]}"


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _read(store, tenant: str, file_id: str) -> tuple[bytes, list[int]]:
    pieces = [piece async for piece in store.read(tenant, file_id)]
    return b"".join(pieces), [len(p) for p in pieces]


async def _rows(pool, tenant: str) -> tuple[int, int]:
    """The tenant's files (any status) and their parts."""
    files = await pool.fetchval("SELECT count(*) FROM files WHERE tenant = $1", tenant)
    parts = await pool.fetchval(
        "SELECT count(*) FROM file_parts p JOIN files f ON f.id = p.file_id WHERE f.tenant = $1", tenant
    )
    return files, parts


async def test_round_trip_in_pieces(store, pool, tenant):
    data = [b"abc", b"defghijklmnop", b"", b"qrstuvwxyz0123456789!"]
    record = await store.create(
        tenant=tenant, purpose="batch", filename="in.jsonl", chunks=_chunks(*data), max_bytes=1000
    )
    assert record.id.startswith("file-")
    assert record.bytes == 37 and record.status == "processed" and record.filename == "in.jsonl"
    # A batch file expires after 30 days, as OpenAI's.
    assert record.expires_at == record.created_at + 30 * 86_400
    assert abs(record.created_at - time.time()) < 60
    assert await store.get(tenant, record.id) == record
    body, sizes = await _read(store, tenant, record.id)
    assert body == b"".join(data)
    assert sizes == [10, 10, 10, 7]
    assert await _rows(pool, tenant) == (1, 4)
    assert record.to_openai() == {
        "id": record.id,
        "object": "file",
        "bytes": 37,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "filename": "in.jsonl",
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
    }


async def test_other_purposes_do_not_expire_unless_asked(store, tenant):
    kept = await store.create(tenant=tenant, purpose="user_data", filename="a", chunks=_chunks(b"x"), max_bytes=10)
    assert kept.expires_at is None
    soon = await store.create(
        tenant=tenant, purpose="batch", filename="a", chunks=_chunks(b"x"), max_bytes=10, expires_after_s=3600
    )
    assert soon.expires_at == soon.created_at + 3600


async def test_another_tenants_file_is_absent(store, tenant):
    record = await store.create(tenant=tenant, purpose="batch", filename="f", chunks=_chunks(b"x" * 25), max_bytes=100)
    assert await store.get("someone-else", record.id) is None
    with pytest.raises(FileGone):
        await _read(store, "someone-else", record.id)
    assert await store.delete("someone-else", record.id) is False
    assert await store.list("someone-else", purpose=None, after=None, limit=10, order="desc") == ([], False)
    assert await store.get(tenant, record.id) == record
    assert await store.get(tenant, "file-unknown") is None
    assert await store.get(tenant, "not-a-file-id") is None


async def test_another_deployments_file_is_absent_and_left_to_its_sweep(store, pool, content, tenant):
    theirs = DatabaseFileStore(pool, content, namespace=f"theirs-{uuid.uuid4().hex[:8]}")
    record = await theirs.create(tenant=tenant, purpose="batch", filename="f", chunks=_chunks(b"x" * 25), max_bytes=100)
    assert await store.get(tenant, record.id) is None
    assert await store.list(tenant, purpose=None, after=None, limit=10, order="desc") == ([], False)
    assert await store.delete(tenant, record.id) is False
    await pool.execute("UPDATE files SET expires_at = now() - interval '1 second' WHERE id = $1", record.id)
    await store.sweep()
    assert await _rows(pool, tenant) == (1, 3)
    assert await theirs.sweep() == 1
    assert await _rows(pool, tenant) == (0, 0)


@pytest.mark.parametrize("max_bytes", [24, 1])
async def test_too_large_leaves_nothing(store, pool, tenant, max_bytes):
    with pytest.raises(FileTooLarge) as raised:
        await store.create(
            tenant=tenant, purpose="batch", filename="big", chunks=_chunks(b"x" * 20, b"y" * 5), max_bytes=max_bytes
        )
    assert raised.value.status_code == 413 and str(max_bytes) in raised.value.message
    assert await _rows(pool, tenant) == (0, 0)


async def test_exactly_the_limit_is_taken(store, tenant):
    record = await store.create(tenant=tenant, purpose="batch", filename="f", chunks=_chunks(b"x" * 25), max_bytes=25)
    assert record.bytes == 25


async def test_empty_leaves_nothing(store, pool, tenant):
    with pytest.raises(EmptyFile) as raised:
        await store.create(tenant=tenant, purpose="batch", filename="e", chunks=_chunks(b"", b""), max_bytes=10)
    assert raised.value.status_code == 400
    assert await _rows(pool, tenant) == (0, 0)


async def test_an_upload_that_fails_midway_leaves_nothing(store, pool, tenant):
    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * 35  # three pieces written
        raise ConnectionResetError("client gone")

    with pytest.raises(ConnectionResetError):
        await store.create(tenant=tenant, purpose="batch", filename="b", chunks=broken(), max_bytes=1000)
    assert await _rows(pool, tenant) == (0, 0)


async def test_a_cancelled_upload_leaves_nothing(store, pool, tenant):
    arrived = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b"x" * 30
        arrived.set()
        await asyncio.Event().wait()
        yield b"never"

    task = asyncio.create_task(
        store.create(tenant=tenant, purpose="batch", filename="c", chunks=stalled(), max_bytes=1000)
    )
    await asyncio.wait_for(arrived.wait(), timeout=10)
    # While it is being uploaded, the file is nowhere to be seen.
    assert await store.list(tenant, purpose=None, after=None, limit=10, order="desc") == ([], False)
    assert (await _rows(pool, tenant))[0] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _rows(pool, tenant) == (0, 0)


async def test_delete_removes_the_bytes(store, pool, tenant):
    record = await store.create(tenant=tenant, purpose="batch", filename="d", chunks=_chunks(b"z" * 42), max_bytes=100)
    assert await store.delete(tenant, record.id) is True
    assert await store.get(tenant, record.id) is None
    assert await store.delete(tenant, record.id) is False
    assert await _rows(pool, tenant) == (0, 0)


async def test_a_file_deleted_while_read_ends_the_read(store, tenant):
    record = await store.create(tenant=tenant, purpose="batch", filename="r", chunks=_chunks(b"q" * 50), max_bytes=100)
    reading = store.read(tenant, record.id)
    assert await anext(reading) == b"q" * 10
    await store.delete(tenant, record.id)
    with pytest.raises(FileGone):
        async for _ in reading:
            pass


async def test_list_pages(store, tenant):
    made = []
    for index in range(5):
        purpose = "user_data" if index == 2 else "batch"
        made.append(
            await store.create(tenant=tenant, purpose=purpose, filename=f"f{index}", chunks=_chunks(b"x"), max_bytes=10)
        )
    newest_first = [r.id for r in reversed(made)]
    page, more = await store.list(tenant, purpose=None, after=None, limit=2, order="desc")
    assert [r.id for r in page] == newest_first[:2] and more
    page, more = await store.list(tenant, purpose=None, after=page[-1].id, limit=2, order="desc")
    assert [r.id for r in page] == newest_first[2:4] and more
    page, more = await store.list(tenant, purpose=None, after=page[-1].id, limit=2, order="desc")
    assert [r.id for r in page] == newest_first[4:] and not more
    page, more = await store.list(tenant, purpose=None, after=None, limit=10, order="asc")
    assert [r.id for r in page] == [r.id for r in made] and not more
    page, more = await store.list(tenant, purpose="batch", after=made[0].id, limit=10, order="asc")
    assert [r.id for r in page] == [made[1].id, made[3].id, made[4].id] and not more
    assert await store.list(tenant, purpose=None, after="file-unknown", limit=10, order="asc") == ([], False)
    # Text PostgreSQL cannot hold (U+0000) matches nothing, and is no error.
    assert await store.list(tenant, purpose="ba\x00tch", after=None, limit=10, order="asc") == ([], False)
    assert await store.list(tenant, purpose=None, after="file-\x00", limit=10, order="asc") == ([], False)
    assert await store.get(tenant, "file-\x00") is None
    assert await store.delete(tenant, "file-\x00") is False


async def test_sweep_removes_expired_and_abandoned(store, pool, tenant):
    expired = await store.create(tenant=tenant, purpose="batch", filename="x", chunks=_chunks(b"x" * 15), max_bytes=100)
    kept = await store.create(tenant=tenant, purpose="batch", filename="k", chunks=_chunks(b"k"), max_bytes=100)
    await pool.execute("UPDATE files SET expires_at = now() - interval '1 second' WHERE id = $1", expired.id)
    assert await store.get(tenant, expired.id) is None  # past its expiry, before any sweep
    # An upload whose process died: `uploading`, its pieces not touched for over an hour.
    abandoned = f"file-{uuid.uuid4().hex[:24]}"
    await pool.execute(
        "INSERT INTO files (id, tenant, purpose, filename, status, created_at, touched_at)"
        " VALUES ($1, $2, 'batch', 'a', 'uploading', now(), now() - interval '2 hours')",
        abandoned,
        tenant,
    )
    await pool.execute("INSERT INTO file_parts (file_id, seq, data) VALUES ($1, 0, 'abc')", abandoned)
    assert await store.sweep() >= 2
    assert await pool.fetchval("SELECT array_agg(id) FROM files WHERE tenant = $1", tenant) == [kept.id]
    assert await _rows(pool, tenant) == (1, 1)


async def test_a_live_upload_keeps_itself_from_the_sweep(store, pool, tenant):
    """Each piece moves the upload's `touched_at`, so a slow upload still receiving pieces is not
    taken for one whose process died."""
    taken = [asyncio.Event(), asyncio.Event()]
    go_on = [asyncio.Event(), asyncio.Event()]

    async def slow() -> AsyncIterator[bytes]:
        for step, piece in enumerate((b"a" * 10, b"b" * 10)):
            yield piece
            taken[step].set()  # the piece before is stored
            await go_on[step].wait()
        yield b"c" * 10

    task = asyncio.create_task(store.create(tenant=tenant, purpose="batch", filename="s", chunks=slow(), max_bytes=100))
    await asyncio.wait_for(taken[0].wait(), timeout=10)
    await pool.execute("UPDATE files SET touched_at = now() - interval '2 hours' WHERE tenant = $1", tenant)
    go_on[0].set()
    await asyncio.wait_for(taken[1].wait(), timeout=10)
    await store.sweep()  # the second piece moved touched_at: still live
    assert await pool.fetchval("SELECT status FROM files WHERE tenant = $1", tenant) == "uploading"
    go_on[1].set()
    record = await asyncio.wait_for(task, timeout=10)
    assert b"".join([p async for p in store.read(tenant, record.id)]) == b"a" * 10 + b"b" * 10 + b"c" * 10
