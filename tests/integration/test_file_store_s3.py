"""The file store with its bytes in S3 (AXON_FILE_STORE=s3), against a real S3 endpoint: the one
AXON_TEST_S3_ENDPOINT names (credentials from the environment), else moto's S3 server started
here. A file goes in as a multipart upload of several parts and comes back whole; an upload that
fails leaves no object and no multipart upload behind; deleting and sweeping remove objects."""

import asyncio
import os
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from services.sessions.files.s3 import S3Content, open_s3_content
from services.sessions.files.store import DatabaseFileStore, EmptyFile, FileTooLarge
from services.sessions.settings import SessionsSettings

MIB = 1024 * 1024


@pytest.fixture
async def content(s3_endpoint: str) -> AsyncIterator[S3Content]:
    bucket = os.environ.get("AXON_TEST_S3_BUCKET", "axon-test-files")
    settings = SessionsSettings(
        file_store="s3",
        file_s3_bucket=bucket,
        file_s3_prefix=f"test-{uuid.uuid4().hex[:8]}/",
        file_s3_endpoint=s3_endpoint,
        file_s3_region="us-east-1",
    )
    async with open_s3_content(settings) as content:
        client = content._client
        try:
            await client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        yield content


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.fixture
def store(pool: asyncpg.Pool, content: S3Content) -> DatabaseFileStore:
    return DatabaseFileStore(pool, content, namespace="axon")


async def _chunks(data: bytes, size: int = 256 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _objects(content: S3Content) -> list[str]:
    listed = await content._client.list_objects_v2(Bucket=content._bucket, Prefix=content._prefix)
    return [entry["Key"] for entry in listed.get("Contents", [])]


async def _uploads(content: S3Content) -> list[str]:
    listed = await content._client.list_multipart_uploads(Bucket=content._bucket, Prefix=content._prefix)
    return [entry["Key"] for entry in listed.get("Uploads", [])]


async def test_round_trip_as_a_multipart_upload(store: DatabaseFileStore, content: S3Content) -> None:
    data = os.urandom(2 * content.piece_bytes + 3 * MIB)  # three parts, the last one short
    tenant = f"s3-{uuid.uuid4().hex[:8]}"
    record = await store.create(
        tenant=tenant, purpose="batch", filename="in.jsonl", chunks=_chunks(data), max_bytes=10**9
    )
    assert record.bytes == len(data)
    assert await _objects(content) == [content.key(record.id)]
    assert await _uploads(content) == []
    read = [piece async for piece in store.read(tenant, record.id)]
    assert b"".join(read) == data
    assert max(len(piece) for piece in read) <= 1024 * 1024 * 8
    assert await store.get("someone-else", record.id) is None
    assert await store.delete(tenant, record.id)
    assert await _objects(content) == []


@pytest.mark.parametrize("failure", ["too_large", "empty", "client_gone"])
async def test_a_failed_upload_leaves_nothing(store: DatabaseFileStore, content: S3Content, failure: str) -> None:
    tenant = f"s3-{uuid.uuid4().hex[:8]}"

    async def gone() -> AsyncIterator[bytes]:
        yield os.urandom(content.piece_bytes + MIB)  # one part sent
        raise ConnectionResetError("client gone")

    chunks, max_bytes, raised = {
        "too_large": (_chunks(os.urandom(content.piece_bytes + 2 * MIB)), content.piece_bytes + MIB, FileTooLarge),
        "empty": (_chunks(b""), 100, EmptyFile),
        "client_gone": (gone(), 10**9, ConnectionResetError),
    }[failure]
    with pytest.raises(raised):
        await store.create(tenant=tenant, purpose="batch", filename="f", chunks=chunks, max_bytes=max_bytes)
    assert await _objects(content) == []
    assert await _uploads(content) == []
    assert await store.list(tenant, purpose=None, after=None, limit=10, order="asc") == ([], False)


async def test_a_cancelled_upload_is_aborted(store: DatabaseFileStore, content: S3Content) -> None:
    arrived = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield os.urandom(content.piece_bytes + MIB)
        arrived.set()
        await asyncio.Event().wait()
        yield b"never"

    task = asyncio.create_task(
        store.create(tenant="s3-cancel", purpose="batch", filename="c", chunks=stalled(), max_bytes=10**9)
    )
    await asyncio.wait_for(arrived.wait(), timeout=30)
    await asyncio.sleep(0.5)  # its first part on its way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _uploads(content) == []
    assert await _objects(content) == []


async def test_sweep_removes_expired_objects(store: DatabaseFileStore, content: S3Content, pool: asyncpg.Pool) -> None:
    tenant = f"s3-{uuid.uuid4().hex[:8]}"
    record = await store.create(tenant=tenant, purpose="batch", filename="x", chunks=_chunks(b"x" * 10), max_bytes=100)
    await pool.execute("UPDATE files SET expires_at = now() - interval '1 second' WHERE id = $1", record.id)
    assert await store.sweep() >= 1
    assert await _objects(content) == []
