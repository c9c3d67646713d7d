"""API keys: generation, hashing, storage in PostgreSQL, and a lookup cache in Redis.

A key is shown once, at creation; only its SHA-256 is stored. Keys are 32+ random
bytes, so a fast hash is enough (a slow KDF protects low-entropy passwords, not these).
"""

import datetime as dt
import hashlib
import secrets
from typing import Protocol

import asyncpg
import orjson
import redis.asyncio as redis
from pydantic import BaseModel, Field

from shared.names import Names

KEY_PREFIX = "axk_"
_KEY_RANDOM_BYTES = 32


class KeyLimits(BaseModel):
    """Per-key limits; None means unlimited in that dimension."""

    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=0, le=9)


def limits_with_defaults(
    *,
    rpm: int | None,
    tpm: int | None,
    max_concurrent: int | None,
    priority: int,
    defaults: "KeyDefaults",
) -> KeyLimits:
    """A new key's limits: what was asked for, the configured defaults for the rest."""
    return KeyLimits(
        rpm=rpm or defaults.default_rpm,
        tpm=tpm or defaults.default_tpm,
        max_concurrent=max_concurrent or defaults.default_max_concurrent,
        priority=priority,
    )


class KeyDefaults(Protocol):
    """Read-only: the settings that provide these are frozen."""

    @property
    def default_rpm(self) -> int: ...
    @property
    def default_tpm(self) -> int: ...
    @property
    def default_max_concurrent(self) -> int: ...


class KeyRecord(BaseModel):
    """What the gateway knows about a valid key (never the key itself)."""

    id: str
    name: str
    tenant: str
    display: str
    limits: KeyLimits
    created_at: dt.datetime
    last_used_at: dt.datetime | None = None
    revoked_at: dt.datetime | None = None


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(_KEY_RANDOM_BYTES)


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def display_form(key: str) -> str:
    """`axk_ab…wxyz`: enough to recognise a key, useless to use it."""
    return f"{key[:6]}…{key[-4:]}"


def _record(row: asyncpg.Record) -> KeyRecord:
    return KeyRecord(
        id=row["id"],
        name=row["name"],
        tenant=row["tenant"],
        display=row["display"],
        limits=KeyLimits(
            rpm=row["rpm_limit"],
            tpm=row["tpm_limit"],
            max_concurrent=row["max_concurrent"],
            priority=row["priority"],
        ),
        created_at=row["created_at"],
        last_used_at=row["last_used_at"],
        revoked_at=row["revoked_at"],
    )


_COLUMNS = (
    "id, name, tenant, display, rpm_limit, tpm_limit, max_concurrent, priority, created_at, last_used_at, revoked_at"
)


class KeyRepository:
    """API keys in PostgreSQL."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(self, *, name: str, limits: KeyLimits, tenant: str | None = None) -> tuple[str, KeyRecord]:
        """Create a key. Returns (the key, shown this once; its record)."""
        key = generate_key()
        key_id = "key_" + secrets.token_hex(8)
        row = await self._pool.fetchrow(
            "INSERT INTO api_keys"
            " (id, name, key_hash, display, tenant, rpm_limit, tpm_limit, max_concurrent, priority)"
            f" VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING {_COLUMNS}",
            key_id,
            name,
            hash_key(key),
            display_form(key),
            tenant or key_id,
            limits.rpm,
            limits.tpm,
            limits.max_concurrent,
            limits.priority,
        )
        assert row is not None  # INSERT ... RETURNING always returns the row it inserted
        return key, _record(row)

    async def find_by_hash(self, key_hash: bytes) -> KeyRecord | None:
        """The active key with this hash, or None (unknown or revoked)."""
        row = await self._pool.fetchrow(
            f"SELECT {_COLUMNS} FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL", key_hash
        )
        return _record(row) if row else None

    async def list(self) -> list[KeyRecord]:
        rows = await self._pool.fetch(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, id")
        return [_record(r) for r in rows]

    async def revoke(self, key_id: str) -> bytes | None:
        """Revoke a key; returns its hash (to evict caches) or None if no active key has that id."""
        key_hash: bytes | None = await self._pool.fetchval(
            "UPDATE api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL RETURNING key_hash",
            key_id,
        )
        return key_hash

    async def touch(self, key_id: str) -> None:
        await self._pool.execute("UPDATE api_keys SET last_used_at = now() WHERE id = $1", key_id)


def encode_cached(record: KeyRecord | None) -> bytes:
    return b"-" if record is None else orjson.dumps(record.model_dump(mode="json"))


def decode_cached(raw: bytes) -> KeyRecord | None:
    return None if raw == b"-" else KeyRecord.model_validate(orjson.loads(raw))


async def evict_key(client: redis.Redis, names: Names, key_hash: bytes) -> None:
    """Forget a revoked key in Redis; gateways' in-process caches expire within a second."""
    await client.delete(names.key_cache(key_hash.hex()))
