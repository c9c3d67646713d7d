"""Admin API (`/admin/*`), guarded by `AXON_ADMIN_TOKEN`: API keys, tenants' weights, usage and aliases."""

import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Security
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from services.gateway.api.deps import AdminDep, KeysDep
from services.gateway.api.openapi import admin_bearer_scheme, admin_error_responses
from shared.errors import InvalidRequest, NotFound
from shared.keys import BudgetPeriod, KeyRecord, evict_key, limits_with_defaults
from shared.registry import WorkerRegistry
from shared.tenants import Tenant, TenantStore, WeightChange
from shared.usage import billed_tokens

# In the API document (section Admin) with its own credential; `AdminDep` checks it.
router = APIRouter(
    prefix="/admin", dependencies=[AdminDep, Security(admin_bearer_scheme)], responses=admin_error_responses()
)


# The limit columns of `api_keys` are PostgreSQL integers: a larger limit is a 400, not a failed INSERT.
_MAX_LIMIT = 2**31 - 1
# Budgets are counted in Redis' Lua numbers (doubles): exact up to 2**53.
_MAX_BUDGET = 2**53 - 1
ModelName = Annotated[str, Field(min_length=1, max_length=256)]
AllowedModels = Annotated[list[ModelName], Field(min_length=1, max_length=256)]
# As a key's `tenant`.
TenantPath = Annotated[str, Path(min_length=1, max_length=128)]


def _future(value: dt.datetime | None) -> dt.datetime | None:
    if value is not None and value <= dt.datetime.now(dt.UTC):
        raise ValueError("must be in the future")
    return value


def _distinct(value: list[str] | None) -> list[str] | None:
    return list(dict.fromkeys(value)) if value is not None else None


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    tenant: str | None = Field(None, min_length=1, max_length=128)
    rpm: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    tpm: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    max_concurrent: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    priority: int = Field(0, ge=0, le=9)
    expires_at: AwareDatetime | None = None
    allowed_models: AllowedModels | None = None
    token_budget: int | None = Field(None, ge=1, le=_MAX_BUDGET)
    budget_period: BudgetPeriod = "month"

    _expires_in_future = field_validator("expires_at")(_future)
    _allowed_distinct = field_validator("allowed_models")(_distinct)


class KeyUpdate(BaseModel):
    """A key's changes: a field left out stays as it is; null clears a limit (unlimited), the
    expiry (never) or the allowlist (every model)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=200)
    rpm: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    tpm: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    max_concurrent: int | None = Field(None, ge=1, le=_MAX_LIMIT)
    priority: int | None = Field(None, ge=0, le=9)
    expires_at: AwareDatetime | None = None
    allowed_models: AllowedModels | None = None
    token_budget: int | None = Field(None, ge=1, le=_MAX_BUDGET)
    budget_period: BudgetPeriod | None = None

    _expires_in_future = field_validator("expires_at")(_future)
    _allowed_distinct = field_validator("allowed_models")(_distinct)

    def changes(self) -> dict[str, object]:
        """The fields the body sets. `name`, `priority` and `budget_period` cannot be null.

        Raises:
            InvalidRequest: nothing to change, or null where a value is needed.
        """
        changes = {field: getattr(self, field) for field in sorted(self.model_fields_set)}
        for field in ("name", "priority", "budget_period"):
            if field in changes and changes[field] is None:
                raise InvalidRequest(f"{field}: may not be null.", param=field, code="invalid_request")
        if not changes:
            raise InvalidRequest("Nothing to update: set at least one field.", code="invalid_request")
        return changes


class KeyCreated(KeyRecord):
    key: str = Field(description="The API key. Shown this once; only its hash is stored.")


@router.post("/keys", status_code=201, responses=admin_error_responses(400))
async def create_key(body: KeyCreate, keys: KeysDep, request: Request) -> KeyCreated:
    """Create an API key; the response is the only time the key is shown."""
    limits = limits_with_defaults(
        rpm=body.rpm,
        tpm=body.tpm,
        max_concurrent=body.max_concurrent,
        priority=body.priority,
        defaults=request.app.state.settings,
        token_budget=body.token_budget,
        budget_period=body.budget_period,
    )
    key, record = await keys.create(
        name=body.name,
        limits=limits,
        tenant=body.tenant,
        expires_at=body.expires_at,
        allowed_models=body.allowed_models,
    )
    return KeyCreated(**record.model_dump(), key=key)


@router.get("/keys")
async def list_keys(keys: KeysDep) -> dict[str, Any]:
    """List API keys (display form only) with their limits, budget, expiry and allowed models."""
    return {"object": "list", "data": [r.model_dump(mode="json") for r in await keys.list()]}


@router.patch("/keys/{key_id}", responses=admin_error_responses(400, 404))
async def update_key(key_id: str, body: KeyUpdate, keys: KeysDep, request: Request) -> KeyRecord:
    """Change an active key's limits, budget, expiry or allowed models; every gateway applies the
    change within a second (its cached lookups are evicted, as on revocation)."""
    updated = await keys.update(key_id, body.changes())
    if updated is None:
        raise NotFound(f"No active key with id '{key_id}'.", param="key_id")
    record, key_hash = updated
    await evict_key(request.app.state.redis, request.app.state.names, key_hash)
    return record


@router.delete("/keys/{key_id}", responses=admin_error_responses(404))
async def revoke_key(key_id: str, keys: KeysDep, request: Request) -> dict[str, Any]:
    """Revoke an API key; every gateway refuses it within a second."""
    key_hash = await keys.revoke(key_id)
    if key_hash is None:
        raise NotFound(f"No active key with id '{key_id}'.", param="key_id")
    await evict_key(request.app.state.redis, request.app.state.names, key_hash)
    return {"id": key_id, "revoked": True}


def _tenants(request: Request) -> TenantStore:
    return TenantStore(request.app.state.db, request.app.state.redis, request.app.state.names)


@router.get("/tenants")
async def list_tenants(request: Request) -> dict[str, Any]:
    """List tenants (those of API keys and those given a weight) with their weight and active keys."""
    return {"object": "list", "data": [t.model_dump() for t in await _tenants(request).list()]}


@router.put("/tenants/{tenant}", responses=admin_error_responses(400))
async def set_tenant_weight(tenant: TenantPath, body: WeightChange, request: Request) -> Tenant:
    """Set a tenant's weight, its share of the workers relative to other tenants' (default 1); applied at once."""
    stored, _ = await _tenants(request).set_weight(tenant, body.weight)
    return stored


@router.get("/usage", responses=admin_error_responses(400))
async def usage(
    request: Request,
    since: Annotated[dt.date | None, Query(description="first day (UTC), default 30 days ago")] = None,
    key_id: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    """Usage summed per key and day (UTC), from the daily rollups: kept after the raw rows'
    retention (`AXON_USAGE_RETENTION_DAYS`). `billed_tokens`: the tokens with the batch lines' at
    `AXON_BATCH_BILLING_FACTOR` (as budgets are charged)."""
    factor = request.app.state.settings.batch_billing_factor
    since = since or (dt.datetime.now(dt.UTC).date() - dt.timedelta(days=30))
    rows = await request.app.state.db.fetch(
        "SELECT key_id, day, sum(requests)::bigint AS requests, sum(prompt_tokens)::bigint AS prompt_tokens,"
        " sum(completion_tokens)::bigint AS completion_tokens, sum(batch_requests)::bigint AS batch_requests,"
        " sum(batch_prompt_tokens)::bigint AS batch_prompt_tokens,"
        " sum(batch_completion_tokens)::bigint AS batch_completion_tokens"
        " FROM usage_daily WHERE day >= $1 AND ($2::text IS NULL OR key_id = $2)"
        " GROUP BY key_id, day ORDER BY day, key_id",
        since,
        key_id,
    )
    return {
        "object": "list",
        "data": [
            {
                "key_id": r["key_id"],
                "day": r["day"].isoformat(),
                "requests": r["requests"],
                "prompt_tokens": r["prompt_tokens"],
                "completion_tokens": r["completion_tokens"],
                # Of those, the batch lines' (`/v1/batches`).
                "batch_requests": r["batch_requests"],
                "batch_prompt_tokens": r["batch_prompt_tokens"],
                "batch_completion_tokens": r["batch_completion_tokens"],
                "billed_tokens": _billed(r, factor),
            }
            for r in rows
        ],
    }


def _billed(row: Any, factor: float) -> int:
    """A usage row's tokens, its batch lines' at the billing factor (rounded up once a row)."""
    batch = int(row["batch_prompt_tokens"] + row["batch_completion_tokens"])
    return int(row["prompt_tokens"] + row["completion_tokens"]) - batch + billed_tokens(batch, factor)


class AliasTarget(BaseModel):
    target: str = Field(min_length=1, max_length=256)


def _registry(request: Request) -> WorkerRegistry:
    return WorkerRegistry(request.app.state.redis, request.app.state.names)


@router.get("/models/aliases")
async def list_aliases(request: Request) -> dict[str, Any]:
    """Public model names and the served models they point at."""
    return {
        "object": "list",
        "data": [{"alias": a, "target": t} for a, t in sorted((await _registry(request).aliases()).items())],
    }


@router.put("/models/aliases/{alias}", responses=admin_error_responses(400, 409))
async def set_alias(
    alias: Annotated[str, Path(min_length=1, max_length=256)], body: AliasTarget, request: Request
) -> dict[str, Any]:
    """Point an alias at a served model (atomic; 409 if no live worker serves the target)."""
    await _registry(request).set_alias(alias, body.target)
    return {"alias": alias, "target": body.target}


@router.delete("/models/aliases/{alias}", responses=admin_error_responses(404))
async def remove_alias(alias: str, request: Request) -> dict[str, Any]:
    """Remove an alias."""
    if not await _registry(request).remove_alias(alias):
        raise NotFound(f"No alias '{alias}'.", param="alias")
    return {"alias": alias, "deleted": True}
