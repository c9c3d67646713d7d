"""What the session manager opens while it serves: its connections, the stores built on them and
its background work (persister, liveness beat, queue-depth poller, usage retention), stopped and
closed in order."""

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg
import redis.asyncio as redis
from aio_pika.abc import AbstractRobustConnection

from services.sessions.catalog import ModelCatalog
from services.sessions.chunk_log import ChunkLog
from services.sessions.files.opening import open_file_store
from services.sessions.files.store import FileStore
from services.sessions.history import SessionStore
from services.sessions.job_publishing import JobPublisher
from services.sessions.metrics import SessionsMetrics
from services.sessions.outbox import Outbox
from services.sessions.persister import Persister
from services.sessions.queue_depth import QueueDepthPoller
from services.sessions.relay import TokenRelay
from services.sessions.settings import SessionsSettings
from services.sessions.usage_retention import UsageRetention
from shared.clients import connect_amqp, create_redis
from shared.fair import FairShare
from shared.logging import get_logger
from shared.names import Names
from shared.outages import Outage
from shared.redis_pipe import RedisPipe
from shared.registry import WorkerRegistry

log = get_logger(__name__)

_ALIVE_TTL_S = 10
# How long shutdown waits for the persister to finish the batches it is committing.
_PERSISTER_STOP_S = 5
_ALIVE_EVERY_S = 3


async def _announce_alive(client: redis.Redis, key: str) -> None:
    """Keep this process's liveness key fresh; its session locks are honoured while it exists.
    While Redis is away, tried again with capped backoff, so it is fresh again at once."""
    outage = Outage("alive_beat")
    while True:
        try:
            await client.set(key, b"1", ex=_ALIVE_TTL_S)
        except Exception as exc:  # noqa: BLE001 - retried with backoff
            await asyncio.sleep(outage.failed(exc))
            continue
        outage.recovered()
        await asyncio.sleep(_ALIVE_EVERY_S)


@dataclass(frozen=True)
class SessionsResources:
    """What the session manager opens: its connections and the stores and clients built on them."""

    names: Names
    redis: redis.Redis
    pipe: RedisPipe
    amqp: AbstractRobustConnection
    relay: TokenRelay
    publisher: JobPublisher
    db: asyncpg.Pool
    outbox: Outbox
    store: SessionStore
    catalog: ModelCatalog
    instance_id: str
    chunk_log: ChunkLog
    files: FileStore


@asynccontextmanager
async def open_resources(settings: SessionsSettings, metrics: SessionsMetrics) -> AsyncIterator[SessionsResources]:
    """Open the session manager's connections and start its background work (persister, liveness
    beat, queue-depth poller, usage retention, the files' sweep); on the way out, let the persister finish and close
    everything."""
    names = Names(settings.namespace)
    client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
    # Chunk log reads (replays, and XREAD BLOCK waits that hold a connection each) on a pool of
    # their own: many followers must not starve the session store of connections.
    log_client = create_redis(settings.redis_url, timeout_s=settings.connect_timeout_s)
    # The hot path's commands (usage records, token charges, cancel notices), batched per loop iteration.
    pipe = RedisPipe(settings.redis_url, timeout_s=settings.connect_timeout_s)
    connection = await connect_amqp(settings.amqp_url, timeout_s=settings.connect_timeout_s)
    # The fair share's Redis side, for the publisher and the queue-depth poller (None: it is off).
    fair = FairShare(pipe, names) if settings.fair_share else None
    relay = TokenRelay(
        settings.redis_url,
        names,
        buffer_chunks=settings.stream_buffer_chunks,
        subscribe_timeout_s=settings.subscribe_timeout_s,
        spare_streams=settings.subscribe_ahead,
    )
    publisher = JobPublisher(
        connection,
        names,
        max_queued_jobs=settings.max_queued_jobs,
        publish_timeout_s=settings.publish_timeout_s,
        affinity_wait_ms=settings.affinity_wait_ms,
        routed=metrics.jobs_routed,
        fair=fair,
    )
    # min_size=0: the session manager starts, and chats keep working, while PostgreSQL is down.
    db = await asyncpg.create_pool(
        settings.database_url,
        min_size=0,
        max_size=10,
        timeout=settings.connect_timeout_s,
        command_timeout=settings.connect_timeout_s * 2,
    )
    outbox = Outbox(client, names)
    store = SessionStore(
        client=client,
        db=db,
        names=names,
        outbox=outbox,
        metrics=metrics,
        history_max_messages=settings.history_max_messages,
        cache_ttl_s=settings.session_cache_ttl_s,
    )
    persister = Persister(
        client=client,
        db=db,
        names=names,
        metrics=metrics,
        batch_size=settings.persist_batch_size,
        flush_interval_ms=settings.persist_flush_interval_ms,
        reclaim_after_ms=settings.persist_reclaim_after_ms,
        concurrency=settings.persist_concurrency,
    )
    instance_id = uuid.uuid4().hex
    persisting = asyncio.create_task(persister.run())
    alive = asyncio.create_task(_announce_alive(client, names.sessions_instance(instance_id)))
    retention = asyncio.create_task(UsageRetention(db, retention_days=settings.usage_retention_days).run())
    polling: asyncio.Task[None] | None = None
    try:
        await publisher.start()
        catalog = ModelCatalog(
            WorkerRegistry(client, names),
            cache_ttl_s=settings.models_cache_ttl_s,
            cold_start_wait_s=settings.cold_start_wait_s,
            cold_start_waits=settings.cold_start_waits,
            cold_start_adapters=settings.cold_start_adapters,
        )
        poller = QueueDepthPoller(
            connection=connection,
            catalog=catalog,
            client=client,
            names=names,
            metrics=metrics,
            fair=fair,
            interval_s=settings.queue_poll_interval_s,
        )
        polling = asyncio.create_task(poller.run())
        async with open_file_store(settings, db) as files:
            yield SessionsResources(
                names=names,
                redis=client,
                pipe=pipe,
                amqp=connection,
                relay=relay,
                publisher=publisher,
                db=db,
                outbox=outbox,
                store=store,
                catalog=catalog,
                instance_id=instance_id,
                chunk_log=ChunkLog(log_client, names, block_s=settings.connect_timeout_s / 2),
                files=files,
            )
    finally:
        persister.stop()  # batches being committed finish; what is left stays pending, for a live persister
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(persisting), _PERSISTER_STOP_S)
        background = [t for t in (persisting, alive, retention, polling) if t is not None]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await relay.stop()
        with contextlib.suppress(Exception):
            await connection.close()
        await pipe.aclose()
        await client.aclose()
        await log_client.aclose()
        await db.close()
