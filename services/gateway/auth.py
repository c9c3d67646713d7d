"""Who is calling: the API key behind `Authorization`, looked up to its tenant and limits."""

import asyncio
import datetime as dt
import time

import asyncpg
import redis.asyncio as redis
from redis.exceptions import RedisError

from services.gateway.metrics import GatewayMetrics
from shared.errors import Unauthorized, Unavailable
from shared.keys import KEY_PREFIX, KeyRecord, KeyRepository, decode_cached, encode_cached, hash_key
from shared.logging import get_logger
from shared.names import Names
from shared.tasks import BackgroundTasks

log = get_logger(__name__)

# last_used_at is written at most this often per key.
_TOUCH_INTERVAL_S = 60


def bearer_key(authorization: str | None) -> str:
    """The API key from an `Authorization: Bearer <key>` header.

    Raises:
        Unauthorized: no header, another scheme, or not an Axon key.
    """
    if not authorization:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key.startswith(KEY_PREFIX) or len(key) > 256:
        raise Unauthorized("Incorrect API key provided.")
    return key


def anthropic_authorization(authorization: str | None, x_api_key: str | None) -> str | None:
    """The `Authorization` a call to Anthropic's routes stands for: its own, else its `x-api-key`
    (the header Anthropic's clients send the key in) as a bearer key."""
    if authorization is None and x_api_key is not None:
        return f"Bearer {x_api_key}"
    return authorization


class Authenticator:
    """Looks keys up in-process (briefly), then in Redis, then in PostgreSQL."""

    def __init__(
        self,
        *,
        repository: KeyRepository,
        client: redis.Redis,
        names: Names,
        metrics: GatewayMetrics,
        local_ttl_s: float,
        redis_ttl_s: int,
    ) -> None:
        self._repository = repository
        self._redis = client
        self._names = names
        self._metrics = metrics
        self._local_ttl_s = local_ttl_s
        self._redis_ttl_s = redis_ttl_s
        self._local: dict[bytes, tuple[float, KeyRecord | None]] = {}
        self._in_flight: dict[bytes, asyncio.Future[KeyRecord | None]] = {}
        self._background = BackgroundTasks()

    async def authenticate(self, authorization: str | None) -> KeyRecord:
        """The active key behind the header.

        Raises:
            Unauthorized: missing, unknown or revoked key; an expired one (`key_expired`).
        """
        try:
            key = bearer_key(authorization)
        except Unauthorized:
            self._metrics.auth_failures.labels("malformed" if authorization else "missing").inc()
            raise
        key_hash = hash_key(key)
        cached = self._local.get(key_hash)
        if cached is not None and cached[0] > time.monotonic():
            record = cached[1]
        else:
            record = await self._lookup_once(key_hash)
        if record is None:
            self._metrics.auth_failures.labels("unknown").inc()
            raise Unauthorized("Incorrect API key provided.")
        if record.expired(time.time()):
            assert record.expires_at is not None
            self._metrics.auth_failures.labels("expired").inc()
            raise Unauthorized(
                f"This API key expired at {record.expires_at.astimezone(dt.UTC):%Y-%m-%dT%H:%M:%SZ}.",
                code="key_expired",
            )
        return record

    async def _lookup_once(self, key_hash: bytes) -> KeyRecord | None:
        """Look a key up and cache the answer in-process. Concurrent requests with the same key
        share one lookup: a burst on a cold gateway makes one query, not one per request."""
        pending = self._in_flight.get(key_hash)
        if pending is not None:
            return await asyncio.shield(pending)
        pending = asyncio.ensure_future(self._lookup(key_hash))
        self._in_flight[key_hash] = pending
        try:
            record = await asyncio.shield(pending)
        finally:
            self._in_flight.pop(key_hash, None)
        if len(self._local) > 100_000:
            self._local.clear()
        self._local[key_hash] = (time.monotonic() + self._local_ttl_s, record)
        if record is not None:
            self._background.spawn(self._touch(record.id))
        return record

    async def _lookup(self, key_hash: bytes) -> KeyRecord | None:
        try:
            return await self._lookup_cached(key_hash)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.error("key_lookup_failed", error=repr(exc))
            raise Unavailable("Authentication is unavailable; try again shortly.", retry_after_s=2) from exc

    async def _lookup_cached(self, key_hash: bytes) -> KeyRecord | None:
        cache_key = self._names.key_cache(key_hash.hex())
        try:
            raw = await self._redis.get(cache_key)
            if raw is not None:
                # redis-py types GET as `bytes | str` whatever the client; this one does not decode responses.
                return decode_cached(raw)  # type: ignore[arg-type]
        except RedisError as exc:
            self._metrics.auth_fallbacks.inc()
            log.warning("key_cache_unavailable", error=repr(exc))
            return await self._repository.find_by_hash(key_hash)
        record = await self._repository.find_by_hash(key_hash)
        try:
            await self._redis.set(cache_key, encode_cached(record), ex=self._redis_ttl_s)
        except RedisError as exc:
            log.warning("key_cache_write_failed", error=repr(exc))
        return record

    async def _touch(self, key_id: str) -> None:
        try:
            if await self._redis.set(self._names.key_touched(key_id), b"1", nx=True, ex=_TOUCH_INTERVAL_S):
                await self._repository.touch(key_id)
        except Exception as exc:  # noqa: BLE001 - bookkeeping must never fail a request
            log.warning("key_touch_failed", error=repr(exc))
