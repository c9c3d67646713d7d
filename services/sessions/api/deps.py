"""The caller identity the gateway forwards (`caller_from`, read by the hot completion routes
too) and the FastAPI dependency for it.

Every dependency is `async def`: FastAPI runs a plain `def` one in a thread pool, a thread hop
per request.
"""

from typing import Annotated

from fastapi import Depends, Request
from starlette.types import Scope

from services.sessions.service import Caller
from shared.errors import InvalidRequest
from shared.hot_routes import header
from shared.logging import bind_contextvars
from shared.ratelimit import BudgetReservation

# Headers the gateway sets after authenticating the caller. The session manager is internal:
# only the gateway can reach it (NetworkPolicy in the Helm chart).
TENANT_HEADER = b"x-axon-tenant"
# The concurrency lease a completion holds: the session manager releases it when the answer ends.
LEASE_HEADER = b"x-axon-lease-id"
# The tokens of the key's budget the gateway reserved: settled to the real usage when the answer ends.
BUDGET_HEADER = b"x-axon-budget-reservation"


def caller_from(scope: Scope) -> Caller:
    """Who is asking, from the headers the gateway set.

    Raises:
        InvalidRequest: a header is missing or out of range.
    """
    tenant = header(scope, TENANT_HEADER)
    if not tenant or len(tenant) > 128:
        raise InvalidRequest("x-axon-tenant: a tenant of 1 to 128 characters is required.", param="x-axon-tenant")
    key_id = header(scope, b"x-axon-key-id")
    if key_id is not None and len(key_id) > 64:
        raise InvalidRequest("x-axon-key-id: at most 64 characters.", param="x-axon-key-id")
    lease_id = header(scope, LEASE_HEADER)
    if lease_id is not None and len(lease_id) > 64:
        raise InvalidRequest("x-axon-lease-id: at most 64 characters.", param="x-axon-lease-id")
    budget = None
    reservation = header(scope, BUDGET_HEADER)
    if reservation is not None:
        try:
            budget = BudgetReservation.parse(reservation)
        except ValueError:
            raise InvalidRequest(
                "x-axon-budget-reservation: must be <period>:<id>:<tokens>.", param="x-axon-budget-reservation"
            ) from None
    bind_contextvars(tenant=tenant)
    return Caller(
        tenant=tenant,
        priority=_int_header(scope, b"x-axon-priority", high=9),
        key_id=key_id,
        tpm_limit=_int_header(scope, b"x-axon-tpm-limit"),
        prompt_estimate=_int_header(scope, b"x-axon-prompt-estimate"),
        lease_id=lease_id,
        budget=budget,
    )


def _int_header(scope: Scope, name: bytes, *, high: int | None = None) -> int:
    raw = header(scope, name)
    if raw is None:
        return 0
    if not raw.isdigit() or (high is not None and int(raw) > high):
        bounds = f"0 to {high}" if high is not None else "a whole number of at least 0"
        raise InvalidRequest(f"{name.decode()}: must be {bounds}.", param=name.decode())
    return int(raw)


async def get_caller(request: Request) -> Caller:
    # Async, so it runs in the request's task and the tenant it binds reaches every later log line.
    return caller_from(request.scope)


CallerDep = Annotated[Caller, Depends(get_caller)]
