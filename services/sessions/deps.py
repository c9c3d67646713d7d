"""What a route handler needs, typed: the caller identity the gateway forwards (`caller_from`,
read by the hot completion routes too, and `CallerDep`), and the session manager's services
(`services_of` for the hot routes, `ServicesDep` for FastAPI routes), built once at start-up.

Every dependency is `async def`: FastAPI runs a plain `def` one in a thread pool, a thread hop
per request.
"""

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Annotated, cast

from fastapi import Depends, Request
from starlette.types import Scope

from services.sessions.batches.service import BatchService
from services.sessions.catalog import ModelCatalog
from services.sessions.chat.service import ChatService
from services.sessions.chunk_log import ChunkLog
from services.sessions.completions import CompletionService
from services.sessions.files.store import FileStore
from services.sessions.history import SessionStore
from services.sessions.messages.service import MessagesService
from services.sessions.metrics import SessionsMetrics
from services.sessions.responses.service import ResponsesService
from services.sessions.run_on import RunOn
from shared import internal_headers
from shared.errors import AxonError
from shared.internal_headers import Caller
from shared.logging import bind_contextvars
from shared.openai_requests import RequestLimits
from shared.tracing import Tracing

# The gateway forwards bodies of at most AXON_MAX_BODY_BYTES; this only bounds a bad internal caller.
MAX_BODY_BYTES = 64 * 1024 * 1024


def caller_from(scope: Scope) -> Caller:
    """Who is asking, from the `x-axon-*` headers the gateway set (`shared/internal_headers.py`).
    The session manager is internal: only the gateway can reach it (NetworkPolicy in the Helm chart).

    Raises:
        InvalidRequest: a header is missing or out of range.
    """
    caller = internal_headers.decode(scope)
    bind_contextvars(tenant=caller.tenant)
    return caller


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
    messages: MessagesService
    run_on: RunOn
    catalog: ModelCatalog
    sessions: SessionStore
    chunk_log: ChunkLog
    metrics: SessionsMetrics
    request_limits: RequestLimits
    files: FileStore
    batches: BatchService
    # The largest file an upload may store (AXON_FILE_MAX_BYTES).
    file_max_bytes: int
    tracing: Tracing | None = None

    async def counted(self, path: str, model: str, answer: Awaitable[int]) -> None:
        """Await `answer` (it returns the status it sent) and count the completion request by
        path, model and status: an error's own status, 499 for a client gone (or the process
        stopping), 500 for anything else."""
        status = 500
        try:
            status = await answer
        except AxonError as exc:
            status = exc.status_code
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.metrics.completion_requests.labels(path, self.catalog.label(model), str(status)).inc()


def services_of(scope: Scope) -> SessionServices:
    """The services, from a hot route's ASGI scope."""
    return cast(SessionServices, scope["app"].state.services)


async def get_services(request: Request) -> SessionServices:
    return services_of(request.scope)


ServicesDep = Annotated[SessionServices, Depends(get_services)]
