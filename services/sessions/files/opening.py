"""The file store the settings ask for (AXON_FILE_STORE), open while the session manager serves,
with its sweep of expired files and abandoned uploads running."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from services.sessions.files.store import DatabaseFileStore, FileContent, PostgresContent
from services.sessions.settings import SessionsSettings
from shared.outages import Outage

SWEEP_EVERY_S = 300.0


async def _sweep(store: DatabaseFileStore, *, every_s: float) -> None:
    """Sweep now and every `every_s`; while PostgreSQL is away, again with capped backoff."""
    outage = Outage("files_sweep")
    while True:
        try:
            while await store.sweep():
                pass
        except Exception as exc:  # noqa: BLE001 - retried with backoff
            await asyncio.sleep(outage.failed(exc))
            continue
        outage.recovered()
        await asyncio.sleep(every_s)


@asynccontextmanager
async def open_file_store(settings: SessionsSettings, db: asyncpg.Pool) -> AsyncIterator[DatabaseFileStore]:
    """The file store on `db` (records) and its bytes where AXON_FILE_STORE says."""
    async with _open_content(settings, db) as content:
        store = DatabaseFileStore(db, content, namespace=settings.namespace)
        sweeping = asyncio.create_task(_sweep(store, every_s=SWEEP_EVERY_S))
        try:
            yield store
        finally:
            sweeping.cancel()
            await asyncio.gather(sweeping, return_exceptions=True)


@asynccontextmanager
async def _open_content(settings: SessionsSettings, db: asyncpg.Pool) -> AsyncIterator[FileContent]:
    if settings.file_store == "postgres":
        yield PostgresContent(db)
        return
    # Imported here: the S3 client's libraries load only where files go to S3.
    from services.sessions.files.s3 import open_s3_content

    async with open_s3_content(settings) as content:
        yield content
