"""FastAPI pieces every HTTP service shares: error mapping, request context, JSON and metrics responses."""

import asyncio
import secrets
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from redis.exceptions import RedisError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.errors import AxonError, InvalidRequest, PayloadTooLarge, RequestTimeout, Unavailable, error_body
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
            "axon_http_requests_total",
            "HTTP requests answered.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "axon_http_request_duration_seconds",
            "From request to the end of the response body.",
            ["route", "method"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
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


SSE_END = b"data: [DONE]\n\n"

# FastAPI's own OpenTelemetry instrumentation, off: Axon exports Prometheus metrics and JSON logs,
# and with it on FastAPI looks up the OpenTelemetry providers (reading the environment) on every
# request.
NO_FASTAPI_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}


class SSEResponse(StreamingResponse):
    """A stream of server-sent events that ends with `data: [DONE]`.

    The piece that carries `[DONE]` also ends the HTTP body, so the chunked-encoding terminator
    goes out in the same write instead of one more (a socket write per message is the dearest
    thing a stream does). Anything the iterator yields after the end is dropped.
    """

    media_type = "text/event-stream"
    body_iterator: AsyncIterable[bytes]

    def __init__(
        self,
        content: AsyncIterable[bytes],
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
        background: BackgroundTask | None = None,
    ) -> None:
        super().__init__(content, status_code, headers, media_type, background)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for piece in self.body_iterator:
            if ended:
                continue
            ended = piece.endswith(SSE_END)
            await send({"type": "http.response.body", "body": piece, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def error_response(exc: AxonError) -> ORJSONResponse:
    return ORJSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def invalid_request(errors: Sequence[Mapping[str, Any]]) -> InvalidRequest:
    """The 400 for a body that failed validation (pydantic's or FastAPI's error list): the first
    error, with the field it is about as `param`."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return InvalidRequest("The request body is not valid JSON.", code="invalid_request")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "Invalid request body")
    return InvalidRequest(f"{param}: {message}" if param else message, param=param, code="invalid_request")


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
        request_id = _incoming_request_id(scope) or secrets.token_hex(16)
        scope.setdefault("state", {})["request_id"] = request_id
        clear_contextvars()
        bind_contextvars(request_id=request_id)
        status: dict[str, int | bool] = {"code": 500}
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
    name: bytes
    value: bytes
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1").strip()
            if 0 < len(text) <= _MAX_REQUEST_ID_LEN and text.isascii() and text.isprintable():
                return text
    return None


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody is left to answer."""


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


# --------------------------------------------------------------------------------------------
# Hot routes: plain ASGI handlers for the few routes every request takes
# --------------------------------------------------------------------------------------------

AsgiHandler = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class HotRoute:
    """A route answered by a plain ASGI handler, ahead of FastAPI's routing.

    `path` is also the route template the HTTP metrics are labelled with.
    """

    method: str
    path: str
    handler: AsgiHandler


class HotRoutes:
    """Answers the routes every completion takes with plain ASGI handlers, skipping FastAPI's
    routing, dependency injection, request and response objects (on the 2-core development VM
    those cost ~450 µs a request, against ~15 µs for this layer). Everything else goes to the
    app. Errors map to responses exactly as in FastAPI's handlers (`exception_response`).

    Handlers find their services on `scope["app"].state`.
    """

    def __init__(self, app: ASGIApp, *, routes: Sequence[HotRoute]) -> None:
        self.app = app
        # Keyed by (method, path); looked up with scope.get(), hence the None.
        self._routes: dict[tuple[str | None, str | None], HotRoute] = {
            (route.method, route.path): route for route in routes
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes.get((scope.get("method"), scope.get("path"))) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = route
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await route.handler(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not DisconnectWatch.caused(scope):
                raise
            if not started:
                await Response(status_code=499)(scope, receive, send)
        except Exception as exc:
            response = exception_response(exc)
            if response is None or started:
                raise
            await response(scope, receive, send)


def header(scope: Scope, name: bytes) -> str | None:
    """The first request header called `name` (lower case), decoded as Latin-1, or None."""
    key: bytes
    value: bytes
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(scope: Scope, receive: Receive, *, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """The request body, refused as soon as it passes `max_bytes` (by its Content-Length first).

    Raises:
        PayloadTooLarge: the body is larger than `max_bytes`.
        RequestTimeout: the whole body did not arrive within `timeout_s`.
        ClientGone: the client disconnected before sending it all.
    """
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"The request body is larger than {max_bytes} bytes.")
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(receive, max_bytes=max_bytes)
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s.") from None


async def _read_body(receive: Receive, *, max_bytes: int) -> bytes:
    pieces: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        piece = message.get("body", b"")
        size += len(piece)
        if size > max_bytes:
            raise PayloadTooLarge(f"The request body is larger than {max_bytes} bytes.")
        pieces.append(piece)
        if not message.get("more_body", False):
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def send_json(send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """A complete JSON response, in two ASGI messages."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class DisconnectWatch:
    """Cancels the handler's task if the client disconnects before `stop()`, so its work (a
    generation upstream) is abandoned at once; `HotRoutes` answers that cancellation as 499.

    Start it once the request body has been read: it takes over `receive`.
    """

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._scope = scope
        self._task = asyncio.current_task()
        self._active = True
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    @staticmethod
    def caused(scope: Scope) -> bool:
        """True if a watch cancelled this request's task (and takes that cancellation back)."""
        if not scope.get("axon.disconnected"):
            return False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return True

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._active and self._task is not None:
            self._scope["axon.disconnected"] = True
            self._task.cancel()

    def stop(self) -> None:
        """The answer is complete (or about to be): a disconnect from now on changes nothing."""
        self._active = False
        self._watcher.cancel()
