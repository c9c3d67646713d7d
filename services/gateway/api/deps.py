"""Request dependencies of the public API.

`CallerDep` is the one place that decides who is calling. API keys and rate limits
plug in here, not in the routes.
"""

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from services.gateway.service import Forwarder


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller: its tenant and its job priority (0-9)."""

    tenant: str
    priority: int = 0


def get_caller() -> Caller:
    # Until API keys exist every caller is the anonymous tenant.
    return Caller(tenant="anonymous")


def get_forwarder(request: Request) -> Forwarder:
    return request.app.state.forwarder


CallerDep = Annotated[Caller, Depends(get_caller)]
ForwarderDep = Annotated[Forwarder, Depends(get_forwarder)]
