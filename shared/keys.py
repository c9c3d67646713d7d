"""API keys: generation, hashing, storage in PostgreSQL, and a lookup cache in Redis.

A key is shown once, at creation; only its SHA-256 is stored. Keys are 32+ random
bytes, so a fast hash is enough (a slow KDF protects low-entropy passwords, not these).
"""

import datetime as dt
import hashlib
import secrets
from typing import Literal, Protocol

import asyncpg
import orjson
import redis.asyncio as redis
from pydantic import BaseModel, Field

from shared.names import Names

KEY_PREFIX = "axk_"
_KEY_RANDOM_BYTES = 32

BudgetPeriod = Literal["day", "month"]


class KeyLimits(BaseModel):
    """Per-key limits; None means unlimited in that dimension."""

    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=0, le=9)
    # Tokens (prompt + completion) the key may use per UTC calendar `budget_period`.
    token_budget: int | None = Field(None, ge=1)
    budget_period: BudgetPeriod = "month"


def limits_with_defaults(
    *,
    rpm: int | None,
    tpm: int | None,
    max_concurrent: int | None,
    priority: int,
    defaults: "KeyDefaults",
    token_budget: int | None = None,
    budget_period: BudgetPeriod = "month",
) -> KeyLimits:
    """A new key's limits: what was asked for, the configured defaults for the rest (a token
    budget has no default: none unless asked for)."""
    return KeyLimits(
        rpm=rpm or defaults.default_rpm,
        tpm=tpm or defaults.default_tpm,
        max_concurrent=max_concurrent or defaults.default_max_concurrent,
        priority=priority,
        token_budget=token_budget,
        budget_period=budget_period,
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
    # Refused (401 `key_expired`) from this instant on; None: never expires.
    expires_at: dt.datetime | None = None
    # The models the key may use (aliases resolved: `model_allowed`); None: every model.
    allowed_models: list[str] | None = None

    def expired(self, now: float) -> bool:
        """Whether the key has expired at `now` (a Unix time)."""
        return self.expires_at is not None and self.expires_at.timestamp() <= now


def model_allowed(name: str, allowed: list[str], aliases: dict[str, str]) -> bool:
    """Whether a key whose allowlist is `allowed` may use model `name`, with `aliases` (public
    name -> served model). What is allowed is a served model: a name is allowed when it is listed,
    or when it and a listed name are the same served model (allowing an alias allows its target,
    allowing a model allows its aliases)."""
    if name in allowed:
        return True
    model = aliases.get(name, name)
    return any(aliases.get(entry, entry) == model for entry in allowed)


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
            token_budget=row["token_budget"],
            budget_period=row["budget_period"],
        ),
        created_at=row["created_at"],
        last_used_at=row["last_used_at"],
        revoked_at=row["revoked_at"],
        expires_at=row["expires_at"],
        allowed_models=row["allowed_models"],
    )


_COLUMNS = (
    "id, name, tenant, display, rpm_limit, tpm_limit, max_concurrent, priority, created_at, last_used_at,"
    " revoked_at, expires_at, allowed_models, token_budget, budget_period"
)

# What an update may change: a KeyRecord/KeyLimits field and its column.
UPDATABLE_COLUMNS = {
    "name": "name",
    "rpm": "rpm_limit",
    "tpm": "tpm_limit",
    "max_concurrent": "max_concurrent",
    "priority": "priority",
    "token_budget": "token_budget",
    "budget_period": "budget_period",
    "expires_at": "expires_at",
    "allowed_models": "allowed_models",
}


class KeyRepository:
    """API keys in PostgreSQL."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(
        self,
        *,
        name: str,
        limits: KeyLimits,
        tenant: str | None = None,
        expires_at: dt.datetime | None = None,
        allowed_models: list[str] | None = None,
    ) -> tuple[str, KeyRecord]:
        """Create a key. Returns (the key, shown this once; its record)."""
        key = generate_key()
        key_id = "key_" + secrets.token_hex(8)
        row = await self._pool.fetchrow(
            "INSERT INTO api_keys (id, name, key_hash, display, tenant, rpm_limit, tpm_limit, max_concurrent,"
            " priority, token_budget, budget_period, expires_at, allowed_models)"
            f" VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) RETURNING {_COLUMNS}",
            key_id,
            name,
            hash_key(key),
            display_form(key),
            tenant or key_id,
            limits.rpm,
            limits.tpm,
            limits.max_concurrent,
            limits.priority,
            limits.token_budget,
            limits.budget_period,
            expires_at,
            allowed_models,
        )
        assert row is not None  # INSERT ... RETURNING always returns the row it inserted
        return key, _record(row)

    async def find_by_hash(self, key_hash: bytes) -> KeyRecord | None:
        """The active key with this hash, or None (unknown or revoked)."""
        row = await self._pool.fetchrow(
            f"SELECT {_COLUMNS} FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL", key_hash
        )
        return _record(row) if row else None

    async def get(self, key_id: str) -> KeyRecord | None:
        """The key with this id, revoked or not, or None."""
        row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM api_keys WHERE id = $1", key_id)
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

    async def update(self, key_id: str, changes: dict[str, object]) -> tuple[KeyRecord, bytes] | None:
        """Change an active key's fields (`UPDATABLE_COLUMNS` names; None clears a limit, the
        expiry or the allowlist). Returns its new record and its hash (to evict caches), or None
        if no active key has that id."""
        unknown = set(changes) - set(UPDATABLE_COLUMNS)
        if unknown:
            raise ValueError(f"not updatable: {sorted(unknown)}")
        fields = sorted(changes)
        assignments = ", ".join(f"{UPDATABLE_COLUMNS[f]} = ${i}" for i, f in enumerate(fields, 2))
        row = await self._pool.fetchrow(
            f"UPDATE api_keys SET {assignments or 'id = id'} WHERE id = $1 AND revoked_at IS NULL"
            f" RETURNING {_COLUMNS}, key_hash",
            key_id,
            *(changes[f] for f in fields),
        )
        return (_record(row), bytes(row["key_hash"])) if row else None

    async def touch(self, key_id: str) -> None:
        await self._pool.execute("UPDATE api_keys SET last_used_at = now() WHERE id = $1", key_id)


def encode_cached(record: KeyRecord | None) -> bytes:
    return b"-" if record is None else orjson.dumps(record.model_dump(mode="json"))


def decode_cached(raw: bytes) -> KeyRecord | None:
    return None if raw == b"-" else KeyRecord.model_validate(orjson.loads(raw))


async def evict_key(client: redis.Redis, names: Names, key_hash: bytes) -> None:
    """Forget a revoked or changed key in Redis; gateways' in-process caches expire within a second."""
    await client.delete(names.key_cache(key_hash.hex()))
