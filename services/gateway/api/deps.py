"""Request dependencies of the public and admin APIs.

`CallerDep` is the one place that decides who is calling; `AdminDep` guards /admin. Every
dependency is `async def`: FastAPI runs a plain `def` one in a thread pool.
"""

import hmac
from typing import Annotated

from fastapi import Depends, Header, Request

from services.gateway.auth import Authenticator, anthropic_authorization
from services.gateway.proxy import GatewayService
from shared.anthropic_errors import anthropic_path
from shared.errors import Unauthorized
from shared.keys import KeyRecord, KeyRepository
from shared.logging import bind_contextvars


async def get_caller(
    request: Request,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
    x_api_key: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> KeyRecord:
    authenticator: Authenticator = request.app.state.authenticator
    if anthropic_path(request.url.path):  # Anthropic's clients send the key in `x-api-key`
        authorization = anthropic_authorization(authorization, x_api_key)
    record = await authenticator.authenticate(authorization)
    # The key's id and tenant (never the key) on every later log line of the request.
    bind_contextvars(tenant=record.tenant, key_id=record.id)
    return record


async def require_admin(
    request: Request, authorization: Annotated[str | None, Header(include_in_schema=False)] = None
) -> None:
    expected = request.app.state.settings.admin_token.get_secret_value()
    scheme, _, token = (authorization or "").partition(" ")
    # Constant-time comparison: response timing must not reveal how much of a guess matched.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise Unauthorized("Missing or incorrect admin token.", code="invalid_admin_token")


async def get_service(request: Request) -> GatewayService:
    service: GatewayService = request.app.state.gateway
    return service


async def get_keys(request: Request) -> KeyRepository:
    keys: KeyRepository = request.app.state.keys
    return keys


CallerDep = Annotated[KeyRecord, Depends(get_caller)]
AdminDep = Depends(require_admin)
ServiceDep = Annotated[GatewayService, Depends(get_service)]
KeysDep = Annotated[KeyRepository, Depends(get_keys)]
