"""Request dependencies: the service objects and the caller identity the gateway forwards."""

from typing import Annotated

from fastapi import Depends, Header, Request

from shared.logging import bind_contextvars
from services.sessions.service import Caller, CompletionService

# Headers the gateway sets after authenticating the caller. The session manager is
# internal: only the gateway can reach it (NetworkPolicy in the Helm chart).
TENANT_HEADER = "x-axon-tenant"
PRIORITY_HEADER = "x-axon-priority"


def get_service(request: Request) -> CompletionService:
    return request.app.state.completions


async def get_caller(
    tenant: Annotated[str, Header(alias=TENANT_HEADER, min_length=1, max_length=128)],
    priority: Annotated[int, Header(alias=PRIORITY_HEADER, ge=0, le=9)] = 0,
    key_id: Annotated[str | None, Header(alias="x-axon-key-id", max_length=64)] = None,
    tpm_limit: Annotated[int, Header(alias="x-axon-tpm-limit", ge=0)] = 0,
    prompt_estimate: Annotated[int, Header(alias="x-axon-prompt-estimate", ge=0)] = 0,
) -> Caller:
    # Async, so it runs in the request's task and the binding reaches every later log line.
    bind_contextvars(tenant=tenant)
    return Caller(
        tenant=tenant, priority=priority, key_id=key_id, tpm_limit=tpm_limit, prompt_estimate=prompt_estimate
    )


def get_request_id(request: Request) -> str:
    return request.scope["state"]["request_id"]


ServiceDep = Annotated[CompletionService, Depends(get_service)]
CallerDep = Annotated[Caller, Depends(get_caller)]
RequestIdDep = Annotated[str, Depends(get_request_id)]
