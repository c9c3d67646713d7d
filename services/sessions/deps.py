"""What a route handler needs, typed: the caller identity the gateway forwards (`caller_from`,
read by the hot completion routes too, and `CallerDep`), and the session manager's services
(`services_of` for the hot routes, `ServicesDep` for FastAPI routes), built once at start-up.

Every dependency is `async def`: FastAPI runs a plain `def` one in a thread pool, a thread hop
per request.
"""

from dataclasses import dataclass
from typing import Annotated, cast

from fastapi import Depends, Request
from starlette.types import Scope

from services.sessions.catalog import ModelCatalog
from services.sessions.chat.service import ChatService
from services.sessions.chunk_log import ChunkLog
from services.sessions.completions import CompletionService
from services.sessions.history import SessionStore
from services.sessions.metrics import SessionsMetrics
from services.sessions.responses.service import ResponsesService
from services.sessions.run_on import RunOn
from shared.errors import InvalidRequest
from shared.hot_routes import header
from shared.internal_headers import Caller
from shared.logging import bind_contextvars
from shared.openai_requests import RequestLimits
from shared.ratelimit import BudgetReservation

# The gateway forwards bodies of at most AXON_MAX_BODY_BYTES; this only bounds a bad internal caller.
MAX_BODY_BYTES = 64 * 1024 * 1024
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


@dataclass(frozen=True, slots=True)
class SessionServices:
    """The session manager's services, as the routes use them (`app.state.services`)."""

    completions: CompletionService
    chat: ChatService
    responses: ResponsesService
    run_on: RunOn
    catalog: ModelCatalog
    sessions: SessionStore
    chunk_log: ChunkLog
    metrics: SessionsMetrics
    request_limits: RequestLimits


def services_of(scope: Scope) -> SessionServices:
    """The services, from a hot route's ASGI scope."""
    return cast(SessionServices, scope["app"].state.services)


async def get_services(request: Request) -> SessionServices:
    return services_of(request.scope)


ServicesDep = Annotated[SessionServices, Depends(get_services)]
