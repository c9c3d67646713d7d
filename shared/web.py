"""FastAPI pieces every HTTP service shares: error mapping, request context, JSON and metrics responses."""

import asyncio
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import asyncpg
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.errors import AxonError, Unavailable, error_body
from shared.logging import bind_contextvars, clear_contextvars, get_logger

T = TypeVar("T")
REQUEST_ID_HEADER = "x-request-id"
_MAX_REQUEST_ID_LEN = 128

log = get_logger(__name__)

# Seconds; LLM requests run from milliseconds (errors, listings) to minutes (long answers).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class HttpMetrics:
    """Requests and their duration by route template (never raw paths: ids would explode cardinality)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "axon_http_requests_total", "HTTP requests answered.", ["route", "method", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "axon_http_request_duration_seconds", "From request to the end of the response body.",
            ["route", "method"], buckets=LATENCY_BUCKETS_S, registry=registry,
        )

    def observe(self, scope: Scope, status: int, duration_s: float) -> None:
        route = scope.get("route")
        template = getattr(route, "path", "unmatched")
        self.requests.labels(template, scope["method"], str(status)).inc()
        self.duration.labels(template, scope["method"]).observe(duration_s)


class ORJSONResponse(JSONResponse):
    """JSON response rendered with orjson (faster, and handles non-str keys)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(exc: AxonError) -> ORJSONResponse:
    return ORJSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "Invalid request body")
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    """Map Axon, validation and HTTP errors to OpenAI's error shape; bad input never becomes a 500.

    Unexpected exceptions are answered by `RequestContextMiddleware`.
    """

    @app.exception_handler(AxonError)
    async def _axon_error(_request: Request, exc: AxonError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        body = error_body(message, error_type="invalid_request_error", param=param, code="invalid_request")
        return ORJSONResponse(body, status_code=400)

    app.add_exception_handler(ClientGone, client_gone_handler)

    @app.exception_handler(RedisError)
    @app.exception_handler(asyncpg.PostgresConnectionError)
    @app.exception_handler(asyncpg.InterfaceError)
    @app.exception_handler(ConnectionError)
    @app.exception_handler(TimeoutError)
    async def _dependency_down(_request: Request, exc: Exception) -> Response:
        # A store is unreachable: the client can do nothing but come back, so say when.
        log.warning("dependency_unavailable", error=repr(exc))
        return error_response(Unavailable("A storage service is unavailable; try again shortly.", retry_after_s=2))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), error_type=error_type)
        return ORJSONResponse(body, status_code=exc.status_code, headers=exc.headers)


class RequestContextMiddleware:
    """Gives every HTTP request a request id (taken from `x-request-id` or new), binds it to
    the log context, returns it as a response header and writes one access log line.

    Pure ASGI rather than `BaseHTTPMiddleware`, which would buffer streamed responses.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: HttpMetrics | None = None,
        quiet_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.quiet_paths = quiet_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_request_id(scope) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        clear_contextvars()
        bind_contextvars(request_id=request_id)
        status: dict = {"code": 500}
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            # Answered here rather than by Starlette's outermost error middleware, so even
            # a 500 carries the request id and is counted.
            log.exception("unhandled_error", error=repr(exc))
            if status.get("started"):
                raise
            body = error_body("Internal server error.", error_type="server_error", code="internal_error")
            await ORJSONResponse(body, status_code=500)(scope, receive, send_with_id)
        finally:
            duration_s = time.perf_counter() - started
            if self.metrics is not None:
                self.metrics.observe(scope, status["code"], duration_s)
            if scope["path"] not in self.quiet_paths:
                log.info(
                    "http_request",
                    method=scope["method"],
                    path=scope["path"],
                    status=status["code"],
                    duration_ms=round(duration_s * 1000, 2),
                )


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1").strip()
            if 0 < len(text) <= _MAX_REQUEST_ID_LEN and text.isascii() and text.isprintable():
                return text
    return None


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody is left to answer."""


async def client_gone_handler(_request: Request, _exc: Exception) -> Response:
    # 499 ("client closed request"): never seen by the client, but counted and logged as such.
    return Response(status_code=499)


_DISCONNECT_POLL_S = 0.5


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away (a non-streaming client that gave up),
    so the cancellation travels upstream and the generation stops.

    Raises:
        ClientGone: the client disconnected first.
    """
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone


def metrics_response(registry: CollectorRegistry) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
