"""Hot routes: plain ASGI handlers for the few routes every request takes, ahead of FastAPI, and
the helpers they read requests and write answers with."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.anthropic_errors import anthropic_path
from shared.disconnects import ClientGone, DisconnectWatch
from shared.errors import PayloadTooLarge, RequestTimeout
from shared.http_errors import exception_response

AsgiHandler = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class HotRoute:
    """A route answered by a plain ASGI handler, ahead of FastAPI's routing.

    `path` is also the route template the HTTP metrics are labelled with.
    """

    method: str
    path: str
    handler: AsgiHandler
    # How the OpenAPI document describes it (`APIRouter.add_api_route`'s keywords: summary,
    # description, responses, openapi_extra...; empty: not in the document). `document` adds it.
    openapi: dict[str, Any] = field(default_factory=dict)


async def _answered_by_hot_route() -> None:
    """FastAPI never calls this: `HotRoutes` answers a hot route before FastAPI's routing; it is
    on the router only so that the OpenAPI document describes the route (`document`)."""
    raise RuntimeError("a hot route is answered by HotRoutes")


def document(router: APIRouter, routes: Sequence[HotRoute]) -> None:
    """Describe each of `routes` that has `openapi` in the OpenAPI document of `router`'s app,
    from the same declaration that `HotRoutes` answers it by."""
    for route in routes:
        if route.openapi:
            router.add_api_route(route.path, _answered_by_hot_route, methods=[route.method], **route.openapi)


class HotRoutes:
    """Answers the routes every completion takes with plain ASGI handlers, skipping FastAPI's
    routing, dependency injection, request and response objects (`benchmarks/micro/hot_routes.py`
    measures both in process with 100 requests in flight; figures in benchmarks/RESULTS.md).
    Everything else goes to the app. Errors map to responses exactly as in FastAPI's handlers (`exception_response`).

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
            response = exception_response(exc, anthropic=anthropic_path(scope["path"]))
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


async def stream_body(
    receive: Receive, *, max_bytes: int | None = None, stall_timeout_s: float
) -> AsyncIterator[bytes]:
    """The request body as it arrives (no empty pieces), for bodies too large to hold.

    Raises:
        PayloadTooLarge: more than `max_bytes` arrived (None: no limit).
        RequestTimeout: nothing arrived for `stall_timeout_s`.
        ClientGone: the client disconnected before sending it all.
    """
    size = 0
    while True:
        try:
            async with asyncio.timeout(stall_timeout_s):
                message = await receive()
        except TimeoutError:
            raise RequestTimeout(f"The request body stalled: nothing arrived for {stall_timeout_s:g} s.") from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        piece = message.get("body", b"")
        size += len(piece)
        if max_bytes is not None and size > max_bytes:
            raise PayloadTooLarge(f"The request body is larger than {max_bytes} bytes.")
        if piece:
            yield piece
        if not message.get("more_body", False):
            return


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
