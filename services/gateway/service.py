"""Forwards public API calls to the session manager and streams its answer back unchanged."""

from collections.abc import AsyncIterator

import httpx
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from shared.errors import DeadlineExceeded, InvalidRequest, PayloadTooLarge, Unavailable, error_body
from shared.logging import get_logger

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


async def _relay_stream(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """Pass the event stream through; if the upstream dies mid-stream, end with an error event."""
    try:
        async for piece in upstream.aiter_raw():
            yield piece
    except httpx.HTTPError as exc:
        log.warning("upstream_stream_broken", error=repr(exc))
        yield _STREAM_BROKEN_EVENT


async def read_json_body(request: Request, *, max_bytes: int) -> bytes:
    """Read the body, refusing it as soon as it passes `max_bytes`, and check it is a JSON object.

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
        raise InvalidRequest("The request body is not valid JSON.") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return bytes(body)


class Forwarder:
    """HTTP client to the session manager, one connection pool per process."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def forward(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None,
        headers: dict[str, str],
    ) -> Response:
        """Send the request upstream and relay the response; streams stay streams.

        Raises:
            Unavailable: the session manager cannot be reached.
            DeadlineExceeded: it did not answer in time.
        """
        request = self._client.build_request(method, path, content=body, headers=headers)
        try:
            upstream = await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise DeadlineExceeded("The session manager did not answer in time.") from exc
        except httpx.TransportError as exc:
            log.warning("upstream_unreachable", error=repr(exc))
            raise Unavailable("The session manager is unreachable; try again shortly.", retry_after_s=2) from exc
        response_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                _relay_stream(upstream),
                status_code=upstream.status_code,
                headers=response_headers,
                background=BackgroundTask(upstream.aclose),
            )
        try:
            content = await upstream.aread()
        finally:
            await upstream.aclose()
        return Response(content, status_code=upstream.status_code, headers=response_headers)
