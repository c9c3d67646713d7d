"""Tenants and their fair-share weights: the `tenants` table in PostgreSQL holds them, the Redis
hash `Names.tenant_weights` is the copy the scheduler reads.

A tenant is an API key's `tenant` (by default the key's own id). Its weight (default 1) is its
share of the workers against the other tenants with work waiting: shares are proportional to
weights. A weight is set in PostgreSQL first, then in Redis, so it takes effect at once; every
gateway also copies the whole table into Redis every `AXON_TENANT_WEIGHTS_SYNC_S`
(`keep_weights_synced`), so a weight set while Redis was away, or lost with Redis' data, arrives
within that time. Scheduling itself is not here: this module only says what the weights are.
"""

import asyncio
from typing import Annotated, Literal

import asyncpg
import redis.asyncio as redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import InvalidRequest, invalid_request
from shared.logging import get_logger
from shared.names import Names
from shared.outages import Outage, describe, redis_unreachable

log = get_logger(__name__)

DEFAULT_WEIGHT = 1.0
# The table's CHECK says the same: weights are compared as doubles in Redis' Lua scripts.
MAX_WEIGHT = 1_000_000.0
# As an API key's `tenant` (`KeyCreate.tenant`).
TenantName = Annotated[str, Field(min_length=1, max_length=128)]


class WeightChange(BaseModel):
    """The body of `PUT /admin/tenants/{tenant}`."""

    model_config = ConfigDict(extra="forbid")

    # strict: "3" or true is not a weight; allow_inf_nan: NaN and Infinity (which Python's JSON
    # parser reads) are not either.
    weight: float = Field(
        gt=0,
        le=MAX_WEIGHT,
        strict=True,
        allow_inf_nan=False,
        description="The tenant's share of the workers relative to other tenants' (default 1).",
    )


class Tenant(BaseModel):
    """A tenant as `GET /admin/tenants` lists it."""

    object: Literal["tenant"] = "tenant"
    tenant: str
    weight: float = Field(description="Its share of the workers relative to other tenants' (default 1).")
    keys: int = Field(description="Its API keys that are neither revoked nor expired.")


def checked_weight(value: object) -> float:
    """`value` as a weight, checked as the admin API checks one.

    Raises:
        InvalidRequest: not a number in (0, MAX_WEIGHT] (`param` "weight").
    """
    try:
        return WeightChange.model_validate({"weight": value}).weight
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from None


def weight_from_text(text: str) -> float:
    """A weight typed on a command line (`3`, `0.5`, `1e3`).

    Raises:
        InvalidRequest: not a number in (0, MAX_WEIGHT] (`param` "weight").
    """
    try:
        value = float(text)
    except ValueError:
        raise InvalidRequest(f"weight: {text!r} is not a number", param="weight", code="invalid_request") from None
    return checked_weight(value)


def checked_tenant(text: str) -> str:
    """`text` as a tenant's name (1-128 characters).

    Raises:
        InvalidRequest: too short or too long (`param` "tenant").
    """
    if not 1 <= len(text) <= 128:
        raise InvalidRequest("tenant: must be 1 to 128 characters", param="tenant", code="invalid_request")
    return text


def weight_text(weight: float) -> str:
    """A weight as the Redis hash holds it: "3", "0.5", "1e-05" (what Lua's `tonumber` reads)."""
    return str(int(weight)) if weight.is_integer() else repr(weight)


# A key counts towards its tenant's `keys` while it may be used.
_ACTIVE = "revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())"


class TenantStore:
    """Tenants' weights: PostgreSQL first, then Redis."""

    def __init__(self, pool: asyncpg.Pool, client: redis.Redis, names: Names) -> None:
        self._pool = pool
        self._redis = client
        self._names = names

    async def set_weight(self, tenant: str, weight: float) -> tuple[Tenant, bool]:
        """Store `tenant`'s weight (a checked one: `checked_weight`), then write it to Redis.

        Returns:
            The tenant, and whether Redis took the weight; when Redis is away the gateways' sync
            writes it once Redis is back.
        Raises:
            asyncpg.PostgresError, OSError: PostgreSQL did not store it (nothing changed).
        """
        row = await self._pool.fetchrow(
            "WITH stored AS ("
            " INSERT INTO tenants (tenant, weight) VALUES ($1, $2)"
            " ON CONFLICT (tenant) DO UPDATE SET weight = excluded.weight, updated_at = now()"
            " RETURNING tenant, weight)"
            f" SELECT tenant, weight, (SELECT count(*) FROM api_keys WHERE tenant = $1 AND {_ACTIVE}) AS keys"
            " FROM stored",
            tenant,
            weight,
        )
        assert row is not None  # INSERT ... RETURNING always returns the row it wrote
        stored = Tenant(tenant=row["tenant"], weight=row["weight"], keys=row["keys"])
        try:
            await self._redis.hset(self._names.tenant_weights, tenant, weight_text(stored.weight))
        except Exception as exc:
            if not redis_unreachable(exc):
                raise
            log.warning("tenant_weight_deferred", tenant=tenant, error=describe(exc))
            return stored, False
        return stored, True

    async def list(self) -> list[Tenant]:
        """Every tenant some API key has or that was given a weight, by name."""
        rows = await self._pool.fetch(
            "SELECT coalesce(t.tenant, k.tenant) AS tenant, t.weight, coalesce(k.keys, 0) AS keys"
            " FROM tenants t FULL OUTER JOIN"
            f" (SELECT tenant, count(*) FILTER (WHERE {_ACTIVE}) AS keys FROM api_keys GROUP BY tenant) k"
            " ON k.tenant = t.tenant ORDER BY 1"
        )
        return [Tenant(tenant=r["tenant"], weight=_weight_or_default(r["weight"]), keys=r["keys"]) for r in rows]


def _weight_or_default(weight: float | None) -> float:
    return DEFAULT_WEIGHT if weight is None else weight


async def sync_weights(pool: asyncpg.Pool, client: redis.Redis, names: Names) -> int:
    """Make the Redis hash of weights what the `tenants` table says: write the weights that differ,
    remove the tenants no longer in the table. A weight set between the read and the write may be
    overwritten with the one before it; the next sync repairs that.

    Returns:
        How many fields were written or removed.
    """
    rows = await pool.fetch("SELECT tenant, weight FROM tenants")
    wanted = {row["tenant"].encode(): weight_text(row["weight"]).encode() for row in rows}
    held = await client.hgetall(names.tenant_weights)
    changed = {tenant: weight for tenant, weight in wanted.items() if held.get(tenant) != weight}
    stale = [tenant for tenant in held if tenant not in wanted]
    if changed or stale:
        async with client.pipeline(transaction=True) as pipe:
            if stale:
                pipe.hdel(names.tenant_weights, *stale)
            if changed:
                pipe.hset(names.tenant_weights, mapping=changed)
            await pipe.execute()
    return len(changed) + len(stale)


async def keep_weights_synced(pool: asyncpg.Pool, client: redis.Redis, names: Names, *, interval_s: float) -> None:
    """`sync_weights` now and every `interval_s` until cancelled. A failure (PostgreSQL or Redis
    away) is logged once, then its end, and tried again every `interval_s`."""
    outage = Outage("tenant_weights_sync", first_s=interval_s, cap_s=interval_s)
    while True:
        try:
            written = await sync_weights(pool, client, names)
        except Exception as exc:  # noqa: BLE001 - retried at the next interval
            await asyncio.sleep(outage.failed(exc))
            continue
        outage.recovered()
        if written:
            log.info("tenant_weights_synced", fields=written)
        await asyncio.sleep(interval_s)
