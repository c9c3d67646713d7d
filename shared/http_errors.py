"""The one mapping from exceptions to HTTP answers, for FastAPI routes and hot routes alike: in
OpenAI's error shape, or on Anthropic's routes (`/v1/messages...`) in Anthropic's
(`shared/anthropic_errors.py`)."""

import asyncpg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import iter_route_contexts
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from shared.anthropic_errors import anthropic_error, anthropic_error_body, anthropic_path
from shared.disconnects import ClientGone
from shared.errors import AxonError, InvalidRequest, Unavailable, error_body, invalid_request
from shared.http_responses import ORJSONResponse
from shared.logging import get_logger

log = get_logger(__name__)


def error_response(exc: AxonError, *, anthropic: bool = False) -> ORJSONResponse:
    """`exc`'s answer: OpenAI's shape, or with `anthropic` Anthropic's (status, type, headers)."""
    if anthropic:
        status, body, headers = anthropic_error(exc)
        return ORJSONResponse(body, status_code=status, headers=headers)
    return ORJSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


# Dependencies being unreachable: the client can do nothing but come back, so say when.
_DEPENDENCY_ERRORS = (
    RedisError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    ConnectionError,
    TimeoutError,
)


def exception_response(exc: BaseException, *, anthropic: bool = False) -> Response | None:
    """The response an exception stands for, or None for a bug (answered 500 by
    `RequestContextMiddleware`). The one mapping from exceptions to statuses; `anthropic`: on
    one of Anthropic's routes."""
    if isinstance(exc, AxonError):
        return error_response(exc, anthropic=anthropic)
    if isinstance(exc, ClientGone):
        # 499 ("client closed request"): never seen by the client, but counted and logged as such.
        return Response(status_code=499)
    if isinstance(exc, _DEPENDENCY_ERRORS):
        log.warning("dependency_unavailable", error=repr(exc))
        unavailable = Unavailable("A storage service is unavailable; try again shortly.", retry_after_s=2)
        return error_response(unavailable, anthropic=anthropic)
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Map Axon, validation and HTTP errors to OpenAI's error shape; bad input never becomes a 500.

    Unexpected exceptions are answered by `RequestContextMiddleware`.
    """

    async def _mapped(request: Request, exc: Exception) -> Response:
        response = exception_response(exc, anthropic=anthropic_path(request.url.path))
        assert response is not None
        return response

    for kind in (AxonError, ClientGone, *_DEPENDENCY_ERRORS):
        app.add_exception_handler(kind, _mapped)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        if anthropic_path(request.url.path):
            error = invalid_request(exc.errors())
            message = (
                error.message
                if error.param is None or error.message.startswith(error.param)
                else (f"{error.param}: {error.message}")
            )
            return error_response(InvalidRequest(message, param=error.param), anthropic=True)
        return error_response(invalid_request(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message, headers = str(exc.detail), exc.headers
        if exc.status_code == 404:
            # The router's: no route has this path (a route's own 404s are AxonErrors). OpenAI's words.
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            # Starlette's Allow lists the methods of the first route with this path; FastAPI has a
            # route per method, so list every route's.
            message = f"Method Not Allowed ({request.method} {request.url.path})"
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
        if anthropic_path(request.url.path):
            body = anthropic_error_body(message, status=exc.status_code)
            return ORJSONResponse(body, status_code=exc.status_code, headers=headers)
        return ORJSONResponse(error_body(message, error_type=error_type), status_code=exc.status_code, headers=headers)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app (included routers' too) answers at the request's path, sorted."""
    scope = {**request.scope, "method": ""}
    methods: set[str] = set()
    for route in iter_route_contexts(request.app.router.routes):
        if route.methods and route.matches(scope)[0] is not Match.NONE:
            methods.update(route.methods)
    return sorted(methods)
