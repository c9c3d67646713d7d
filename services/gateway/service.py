"""The gateway's work: check the body, admit the caller, forward to the session manager and
stream its answer back unchanged."""

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import quote, quote_from_bytes

import aiohttp
import orjson
from yarl import URL
from fastapi import Request
from fastapi.routing import APIRoute
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from shared.errors import DeadlineExceeded, InvalidRequest, PayloadTooLarge, Unavailable, error_body
from shared.keys import KeyRecord
from shared.logging import get_logger
from shared.tokens import estimate_tokens
from shared.web import unless_disconnected
from services.gateway.auth import Admission, Admitter

log = get_logger(__name__)

# Response headers that describe the upstream hop, not the answer.
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server", "x-request-id"}
)
_STREAM_BROKEN_EVENT = (
    b"data: "
    + orjson.dumps(
        error_body(
            "The answer's stream was interrupted; the request may be retried.",
            error_type="server_error",
            code="stream_interrupted",
        )
    )
    + b"\n\ndata: [DONE]\n\n"
)


async def read_json_body(request: Request, *, max_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """Read the body, refusing it as soon as it passes `max_bytes`; it must be a JSON object.

    Raises:
        PayloadTooLarge: the body is larger than `max_bytes`.
        InvalidRequest: the body is not a JSON object.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"The request body is larger than {max_bytes} bytes.")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise PayloadTooLarge(f"The request body is larger than {max_bytes} bytes.")
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequest("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return bytes(body), parsed


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens estimated from characters, charged at admission; real usage is settled later."""
    chars, messages = 0, 0
    if isinstance(body.get("messages"), list):
        for message in body["messages"]:
            messages += 1
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                # Any shape may arrive here: the session manager, not the gateway, validates bodies.
                chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) for p in prompt if isinstance(p, str))
    return estimate_tokens(chars=chars, messages=messages)


async def _relay_stream(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Pass the event stream through; if the upstream dies mid-stream, end with an error event."""
    try:
        async for piece in upstream.content.iter_any():
            yield piece
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("upstream_stream_broken", error=repr(exc))
        yield _STREAM_BROKEN_EVENT


def upstream_target(request: Request) -> str:
    """The path and query to forward, with the client's escapes kept.

    The route's own path with each path parameter percent-encoded again: a session id like
    `%2F`, `%0A` or `..` stays one parameter, never a new path segment, an invalid URL or a
    path the HTTP client normalises away. The query string is forwarded as received, with any
    byte that may not appear in a URL percent-encoded.
    """
    route = request.scope.get("route")
    path = request.url.path
    if request.path_params and isinstance(route, APIRoute):
        path = route.path_format.format_map({name: _segment(str(value)) for name, value in request.path_params.items()})
    query = request.scope.get("query_string", b"")
    return path + ("?" + quote_from_bytes(query, safe=_QUERY_SAFE) if query else "")


# What a query string may carry as is (RFC 3986 sub-delims, ':', '@', '/', '?', unreserved, and
# '%' so that the client's escapes stay escapes); everything else is percent-encoded.
_QUERY_SAFE = "!$&'()*+,;=:@/?%-._~"


def _segment(value: str) -> str:
    if value in {".", ".."}:
        return value.replace(".", "%2E")
    return quote(value, safe="")


class Forwarder:
    """HTTP client to the session manager, one connection pool per process (aiohttp: its C
    response parser keeps the relay cheap; httpx cost about half the gateway's CPU)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, *, timeout: aiohttp.ClientTimeout) -> None:
        self._session = session
        self._base_url = base_url.rstrip("/")
        self._timeout = timeout

    async def forward(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None,
        headers: dict[str, str],
        on_close: Callable[[], Awaitable[None]],
    ) -> Response:
        """Send the request upstream and relay the response; streams stay streams.
        `on_close` runs once the answer is complete (or abandoned).

        Raises:
            Unavailable: the session manager cannot be reached.
            DeadlineExceeded: it did not answer in time.
        """
        url = URL(self._base_url + path, encoded=True)  # `path` is already escaped: keep it as is
        try:
            upstream = await self._session.request(method, url, data=body, headers=headers, timeout=self._timeout)
        except TimeoutError as exc:
            await on_close()
            raise DeadlineExceeded("The session manager did not answer in time.") from exc
        except aiohttp.ClientError as exc:
            await on_close()
            log.warning("upstream_unreachable", error=repr(exc))
            raise Unavailable("The session manager is unreachable; try again shortly.", retry_after_s=2) from exc
        response_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):

            async def close() -> None:
                upstream.close()
                await on_close()

            return StreamingResponse(
                _relay_stream(upstream),
                status_code=upstream.status,
                headers=response_headers,
                background=BackgroundTask(close),
            )
        try:
            content = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unavailable("The session manager's answer was cut off; try again.", retry_after_s=1) from exc
        finally:
            upstream.release()
            await on_close()
        return Response(content, status_code=upstream.status, headers=response_headers)


class GatewayService:
    """Admits each call against its key's limits and forwards it."""

    def __init__(self, *, forwarder: Forwarder, admitter: Admitter, max_body_bytes: int) -> None:
        self._forwarder = forwarder
        self._admitter = admitter
        self._max_body_bytes = max_body_bytes

    def _upstream_headers(self, request: Request, record: KeyRecord, *, prompt_estimate: int) -> dict[str, str]:
        return {
            "content-type": "application/json",
            "x-request-id": request.scope["state"]["request_id"],
            "x-axon-tenant": record.tenant,
            "x-axon-priority": str(record.limits.priority),
            "x-axon-key-id": record.id,
            "x-axon-tpm-limit": str(record.limits.tpm or 0),
            "x-axon-prompt-estimate": str(prompt_estimate),
        }

    async def _forward(
        self, request: Request, record: KeyRecord, *, body: bytes | None, token_cost: int
    ) -> Response:
        admission: Admission = await self._admitter.admit(record, token_cost=token_cost)

        async def release() -> None:
            await self._admitter.release(admission)

        response = await unless_disconnected(
            request,
            self._forwarder.forward(
                request.method,
                upstream_target(request),
                body=body,
                headers=self._upstream_headers(request, record, prompt_estimate=token_cost),
                on_close=release,
            ),
        )
        response.headers.update(admission.headers())
        return response

    async def completion(self, request: Request, record: KeyRecord) -> Response:
        """Forward a chat or text completion, charging its estimated prompt tokens."""
        raw, parsed = await read_json_body(request, max_bytes=self._max_body_bytes)
        return await self._forward(request, record, body=raw, token_cost=estimate_prompt_tokens(parsed))

    async def call(self, request: Request, record: KeyRecord) -> Response:
        """Forward any other API call (it counts against the key's request limits)."""
        raw = None
        if request.method in {"POST", "PUT", "PATCH"}:
            raw, _ = await read_json_body(request, max_bytes=self._max_body_bytes)
        return await self._forward(request, record, body=raw, token_cost=0)
