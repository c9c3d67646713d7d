"""Where uploaded files live: their records in PostgreSQL's `files`
(`shared/migrations/sql/0009_files.sql`), their bytes in a `FileContent`: PostgreSQL's
`file_parts` by default (`PostgresContent`), or S3 (`files/s3.py`, AXON_FILE_STORE=s3).

Bytes go in and out in pieces, so a file of any size costs a piece of memory, never the file:
an upload is cut into pieces as it arrives and each is written before the next is read; a
download reads one piece at a time as the client takes them.

Why `bytea` pieces rather than PostgreSQL's large objects: a piece is an ordinary row, so a file's
bytes go with its record (`ON DELETE CASCADE`), are dumped and replicated like any table and need
no `lo_unlink` (a large object whose reference is lost stays forever, and asyncpg has no streaming
API for them: they would be SQL calls per piece all the same). Each piece is one short statement
on a pooled connection, so a slow client holds no connection (or transaction) between pieces.

Every file belongs to the deployment (`AXON_NAMESPACE`) that stored it: deployments sharing the
database never see, list or sweep each other's files (migration 0012).

Nothing is half-stored: a file is `uploading` (seen by no one) until its last piece is written;
one that fails (too large, empty, the client gone, an error) is deleted with its pieces before
the error is raised, and one whose process died mid-upload is removed by `sweep` once its
`touched_at` (moved by each piece) is older than `stale_upload_s`.
"""

import asyncio
import builtins
import datetime as dt
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg

from shared.errors import EmptyFile, FileGone, FileTooLarge
from shared.logging import get_logger
from shared.postgres_text import postgres_text

__all__ = ["DatabaseFileStore", "EmptyFile", "FileContent", "FileGone", "FileRecord", "FileStore", "FileTooLarge"]

log = get_logger(__name__)

FILE_PREFIX = "file-"
# PostgreSQL pieces: big enough that a 200 MB file is 200 rows, small enough to hold one in memory.
PIECE_BYTES = 1024 * 1024
# Files of these purposes expire this long after they were created unless the upload says
# otherwise (OpenAI: batch files after 30 days, all others are kept until deleted).
DEFAULT_EXPIRY_S: dict[str, int] = {"batch": 30 * 86_400, "batch_output": 30 * 86_400}
# An upload no piece was written to for this long belongs to a process that died.
STALE_UPLOAD_S = 3600


def new_file_id() -> str:
    return FILE_PREFIX + secrets.token_hex(12)


@dataclass(frozen=True)
class FileRecord:
    """A stored file as OpenAI's File object describes it."""

    id: str
    tenant: str
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: str

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": self.status,
            "status_details": None,
        }


class FileStore(Protocol):
    """Files by tenant: another tenant's file is as absent as an unknown one."""

    async def create(
        self,
        *,
        tenant: str,
        purpose: str,
        filename: str,
        chunks: AsyncIterator[bytes],
        max_bytes: int,
        expires_after_s: int | None = None,
    ) -> FileRecord:
        """Store the bytes `chunks` yields as a new file, visible once all are stored.
        `expires_after_s` None: the purpose's default (`DEFAULT_EXPIRY_S`, else never).

        Raises:
            FileTooLarge: more than `max_bytes` (nothing kept).
            EmptyFile: no bytes (nothing kept).
        """
        ...

    async def get(self, tenant: str, file_id: str) -> FileRecord | None:
        """The tenant's file, None if unknown, expired, deleted or another tenant's."""
        ...

    def read(self, tenant: str, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, in pieces in order.

        Raises:
            FileGone: no such file (before the first piece), or deleted while being read.
        """
        ...

    async def delete(self, tenant: str, file_id: str) -> bool:
        """Delete the tenant's file and its bytes; False if there was none."""
        ...

    async def list(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, order: str
    ) -> tuple[builtins.list[FileRecord], bool]:
        """A page of the tenant's files by creation time (`order` "asc" or "desc"), after the file
        `after` (an unknown one: an empty page); whether more follow."""
        ...


class FileContent(Protocol):
    """Where a file's bytes go, by file id."""

    # Uploads are cut into pieces of this many bytes (the last one shorter).
    piece_bytes: int

    async def write(self, file_id: str, pieces: AsyncIterator[bytes]) -> None:
        """Store the pieces in order; on any error, nothing of them is left."""
        ...

    def read(self, file_id: str, size: int) -> AsyncIterator[bytes]:
        """The `size` bytes of the file, in pieces.

        Raises:
            FileGone: fewer bytes are there (deleted meanwhile).
        """
        ...

    async def delete(self, file_ids: builtins.list[str]) -> None:
        """Remove these files' bytes (those absent are no error)."""
        ...


class PostgresContent:
    """Bytes as `file_parts` rows of `PIECE_BYTES`, one statement a piece."""

    piece_bytes = PIECE_BYTES

    def __init__(self, db: asyncpg.Pool) -> None:
        self._db = db

    async def write(self, file_id: str, pieces: AsyncIterator[bytes]) -> None:
        # The file's record deletion (by the store, on error) removes the pieces written.
        seq = 0
        async for piece in pieces:
            await self._db.execute(_WRITE_PART, file_id, seq, piece)
            seq += 1

    async def read(self, file_id: str, size: int) -> AsyncIterator[bytes]:
        seq = sent = 0
        while sent < size:
            piece = await self._db.fetchval(_READ_PART, file_id, seq)
            if piece is None:
                raise FileGone.of(file_id)
            sent += len(piece)
            seq += 1
            yield piece

    async def delete(self, file_ids: builtins.list[str]) -> None:
        """Nothing to do: the pieces go with their file's row."""


async def _pieces(
    chunks: AsyncIterator[bytes], *, piece_bytes: int, max_bytes: int, total: list[int]
) -> AsyncIterator[bytes]:
    """`chunks` regrouped into pieces of `piece_bytes` (the last shorter); `total[0]` counts the bytes.

    Raises:
        FileTooLarge: past `max_bytes`, as soon as that many arrived.
    """
    buffer = bytearray()
    async for chunk in chunks:
        total[0] += len(chunk)
        if total[0] > max_bytes:
            raise FileTooLarge.over(max_bytes)
        buffer += chunk
        while len(buffer) >= piece_bytes:
            yield bytes(buffer[:piece_bytes])
            del buffer[:piece_bytes]
    if buffer:
        yield bytes(buffer)


def _epoch(moment: dt.datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def _record(row: asyncpg.Record) -> FileRecord:
    created = _epoch(row["created_at"])
    assert created is not None
    return FileRecord(
        id=row["id"],
        tenant=row["tenant"],
        bytes=row["bytes"],
        created_at=created,
        expires_at=_epoch(row["expires_at"]),
        filename=row["filename"],
        purpose=row["purpose"],
        status=row["status"],
    )


class DatabaseFileStore:
    """`FileStore` of deployment `namespace`, with records in PostgreSQL's `files` and bytes in `content`."""

    def __init__(
        self, db: asyncpg.Pool, content: FileContent, *, namespace: str, stale_upload_s: int = STALE_UPLOAD_S
    ) -> None:
        self._db = db
        self._namespace = namespace
        self._content = content
        self._stale_upload_s = stale_upload_s

    async def create(
        self,
        *,
        tenant: str,
        purpose: str,
        filename: str,
        chunks: AsyncIterator[bytes],
        max_bytes: int,
        expires_after_s: int | None = None,
    ) -> FileRecord:
        file_id = new_file_id()
        created = dt.datetime.now(dt.UTC)
        expiry_s = expires_after_s if expires_after_s is not None else DEFAULT_EXPIRY_S.get(purpose)
        expires = None if expiry_s is None else created + dt.timedelta(seconds=expiry_s)
        await self._db.execute(
            _BEGIN_UPLOAD, file_id, postgres_text(tenant), postgres_text(purpose), postgres_text(filename),
            created, expires, self._namespace,
        )  # fmt: skip
        total = [0]
        try:
            pieces = _pieces(chunks, piece_bytes=self._content.piece_bytes, max_bytes=max_bytes, total=total)
            await self._content.write(file_id, self._touching(file_id, pieces))
            if total[0] == 0:
                raise EmptyFile("File is empty.", param="file")
            row = await self._db.fetchrow(_FINISH_UPLOAD, file_id, total[0])
            if row is None:  # swept as abandoned meanwhile: a stall of over `stale_upload_s`
                raise FileGone.of(file_id)
        except BaseException:
            # Shielded: a cancelled upload (the client left) must still be removed.
            await asyncio.shield(self._discard([file_id]))
            raise
        log.info("file_stored", file_id=file_id, purpose=purpose, bytes=total[0])
        return _record(row)

    async def _touching(self, file_id: str, pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`pieces`, each moving the upload's `touched_at` (the sweep leaves live uploads alone)."""
        async for piece in pieces:
            await self._db.execute(_TOUCH, file_id)
            yield piece

    async def _discard(self, file_ids: builtins.list[str]) -> None:
        try:
            await self._content.delete(file_ids)
            await self._db.execute(_DELETE_FILES, file_ids)
        except Exception as exc:  # noqa: BLE001 - the sweep removes what is left
            log.warning("file_discard_failed", file_ids=file_ids, error=repr(exc))

    async def get(self, tenant: str, file_id: str) -> FileRecord | None:
        if not file_id.startswith(FILE_PREFIX) or len(file_id) > 64:
            return None
        row = await self._db.fetchrow(_GET, postgres_text(file_id), postgres_text(tenant), self._namespace)
        return None if row is None else _record(row)

    async def read(self, tenant: str, file_id: str) -> AsyncIterator[bytes]:
        record = await self.get(tenant, file_id)
        if record is None:
            raise FileGone.of(file_id)
        async for piece in self._content.read(file_id, record.bytes):
            yield piece

    async def delete(self, tenant: str, file_id: str) -> bool:
        if not file_id.startswith(FILE_PREFIX) or len(file_id) > 64:
            return False
        deleted = await self._db.fetchval(_HIDE, postgres_text(file_id), postgres_text(tenant), self._namespace)
        if deleted is None:
            return False
        await self._discard([file_id])
        return True

    async def list(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, order: str
    ) -> tuple[builtins.list[FileRecord], bool]:
        query = _LIST_DESC if order == "desc" else _LIST_ASC
        # Any text may come from a query string: PostgreSQL's cannot hold U+0000 (`postgres_text`).
        rows = await self._db.fetch(
            query, postgres_text(tenant), postgres_text(purpose), postgres_text(after), limit + 1, self._namespace
        )
        return [_record(row) for row in rows[:limit]], len(rows) > limit

    async def sweep(self) -> int:
        """Remove this deployment's expired files and uploads abandoned by a dead process; how many."""
        ids = [row["id"] for row in await self._db.fetch(_SWEEPABLE, self._stale_upload_s, self._namespace)]
        if ids:
            await self._content.delete(ids)
            await self._db.execute(_DELETE_FILES, ids)
            log.info("files_swept", files=len(ids))
        return len(ids)


_COLUMNS = "id, tenant, bytes, created_at, expires_at, filename, purpose, status"
_BEGIN_UPLOAD = """
INSERT INTO files (id, tenant, purpose, filename, status, created_at, expires_at, namespace)
VALUES ($1, $2, $3, $4, 'uploading', $5, $6, $7)
"""
_WRITE_PART = "INSERT INTO file_parts (file_id, seq, data) VALUES ($1, $2, $3)"
_TOUCH = "UPDATE files SET touched_at = now() WHERE id = $1"
_READ_PART = "SELECT data FROM file_parts WHERE file_id = $1 AND seq = $2"
_FINISH_UPLOAD = f"UPDATE files SET status = 'processed', bytes = $2 WHERE id = $1 RETURNING {_COLUMNS}"
_VISIBLE = "status = 'processed' AND (expires_at IS NULL OR expires_at > now())"
_GET = f"SELECT {_COLUMNS} FROM files WHERE id = $1 AND tenant = $2 AND namespace = $3 AND {_VISIBLE}"
# A deleted file is hidden at once (as if being uploaded, long stale), then removed with its bytes.
_HIDE = f"""
UPDATE files SET status = 'uploading', touched_at = '-infinity'
WHERE id = $1 AND tenant = $2 AND namespace = $3 AND {_VISIBLE} RETURNING id
"""
_DELETE_FILES = "DELETE FROM files WHERE id = ANY($1::text[])"
_LIST = f"""
SELECT {_COLUMNS} FROM files
WHERE namespace = $5 AND tenant = $1 AND {_VISIBLE} AND ($2::text IS NULL OR purpose = $2)
  AND ($3::text IS NULL OR (created_at, id) {{op}} (
      SELECT created_at, id FROM files WHERE id = $3 AND tenant = $1 AND namespace = $5))
ORDER BY created_at {{direction}}, id {{direction}} LIMIT $4
"""
_LIST_ASC = _LIST.format(op=">", direction="ASC")
_LIST_DESC = _LIST.format(op="<", direction="DESC")
_SWEEPABLE = """
SELECT id FROM files
WHERE namespace = $2 AND (
    (status = 'uploading' AND touched_at < now() - make_interval(secs => $1))
    OR (expires_at IS NOT NULL AND expires_at <= now()))
LIMIT 1000
"""
