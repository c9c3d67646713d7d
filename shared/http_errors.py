"""The one mapping from exceptions to HTTP answers in OpenAI's error shape, for FastAPI routes and
hot routes alike."""

import asyncpg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.disconnects import ClientGone
from shared.errors import AxonError, Unavailable, error_body, invalid_request
from shared.http_responses import ORJSONResponse
from shared.logging import get_logger

log = get_logger(__name__)


def error_response(exc: AxonError) -> ORJSONResponse:
    return ORJSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


# Dependencies being unreachable: the client can do nothing but come back, so say when.
_DEPENDENCY_ERRORS = (
    RedisError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    ConnectionError,
    TimeoutError,
)


def exception_response(exc: BaseException) -> Response | None:
    """The response an exception stands for, or None for a bug (answered 500 by
    `RequestContextMiddleware`). The one mapping from exceptions to statuses."""
    if isinstance(exc, AxonError):
        return error_response(exc)
    if isinstance(exc, ClientGone):
        # 499 ("client closed request"): never seen by the client, but counted and logged as such.
        return Response(status_code=499)
    if isinstance(exc, _DEPENDENCY_ERRORS):
        log.warning("dependency_unavailable", error=repr(exc))
        return error_response(Unavailable("A storage service is unavailable; try again shortly.", retry_after_s=2))
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Map Axon, validation and HTTP errors to OpenAI's error shape; bad input never becomes a 500.

    Unexpected exceptions are answered by `RequestContextMiddleware`.
    """

    async def _mapped(_request: Request, exc: Exception) -> Response:
        response = exception_response(exc)
        assert response is not None
        return response

    for kind in (AxonError, ClientGone, *_DEPENDENCY_ERRORS):
        app.add_exception_handler(kind, _mapped)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return error_response(invalid_request(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), error_type=error_type)
        return ORJSONResponse(body, status_code=exc.status_code, headers=exc.headers)
