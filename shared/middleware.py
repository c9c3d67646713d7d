"""The context every HTTP request runs in: a request id, one access log line, the HTTP metrics, and
a 500 in OpenAI's error shape for a bug (Anthropic's on its routes, which also get the request id
as `request-id`, the header Anthropic's clients read)."""

import secrets
import time

from fastapi.telemetry import TelemetryConfig
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.anthropic_errors import anthropic_error_body, anthropic_path
from shared.errors import error_body
from shared.http_responses import ORJSONResponse
from shared.logging import bind_contextvars, clear_contextvars, get_logger
from shared.metrics import HttpMetrics
from shared.tracing import TRACE_ID_HEADER, StatusCode, Tracing, trace_id_hex

REQUEST_ID_HEADER = "x-request-id"
# Anthropic's name for it, on Anthropic's routes.
ANTHROPIC_REQUEST_ID_HEADER = "request-id"
_MAX_REQUEST_ID_LEN = 128

log = get_logger(__name__)

# FastAPI's own OpenTelemetry instrumentation, off: Axon exports Prometheus metrics and JSON logs,
# and with it on FastAPI looks up the OpenTelemetry providers (reading the environment) on every
# request.
NO_FASTAPI_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}


class RequestContextMiddleware:
    """Gives every HTTP request a request id (taken from `x-request-id` or new), binds it to
    the log context, returns it as a response header and writes one access log line.

    With `tracing`, every request but the probes also runs in a span of its own (a child of the
    caller's `traceparent`, else a new trace's root), whose trace id is returned in
    `x-axon-trace-id`; its access log line is written inside it.

    Pure ASGI rather than `BaseHTTPMiddleware`, which would buffer streamed responses.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: HttpMetrics | None = None,
        quiet_paths: frozenset[str] = frozenset(),
        tracing: Tracing | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.quiet_paths = quiet_paths
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: dict[str, int | bool] = {"code": 500}
        if self.tracing is not None and scope["path"] not in self.quiet_paths:
            with self.tracing.server_span(scope["method"], scope["headers"]) as span:
                try:
                    await self._handle(scope, receive, send, status, trace_id=trace_id_hex(span))
                finally:
                    route = scope.get("route")
                    span.update_name(f"{scope['method']} {getattr(route, 'path', 'unmatched')}")
                    span.set_attribute("http.response.status_code", status["code"])
                    if status["code"] >= 500:
                        span.set_status(StatusCode.ERROR)
            return
        await self._handle(scope, receive, send, status)

    async def _handle(
        self, scope: Scope, receive: Receive, send: Send, status: dict[str, int | bool], *, trace_id: str | None = None
    ) -> None:
        request_id = _incoming_request_id(scope) or secrets.token_hex(16)
        scope.setdefault("state", {})["request_id"] = request_id
        clear_contextvars()
        bind_contextvars(request_id=request_id)
        started = time.perf_counter()
        anthropic = anthropic_path(scope["path"])

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                if anthropic:
                    headers.append((ANTHROPIC_REQUEST_ID_HEADER.encode(), request_id.encode()))
                if trace_id is not None:
                    headers.append((TRACE_ID_HEADER.encode(), trace_id.encode()))
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
            if anthropic:
                body = anthropic_error_body("Internal server error.", status=500)
            else:
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
