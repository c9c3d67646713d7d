"""Anthropic's Messages API routes (`POST /v1/messages`, `POST /v1/messages/count_tokens`): they
only translate between HTTP and `messages/service.py`.

Both run a completion, so they are hot routes like `/v1/chat/completions` (a client that
disconnects calls its job off). Their errors take Anthropic's shape by their path
(`shared/http_errors.py`).
"""

import orjson
from starlette.types import Receive, Scope, Send

from services.sessions.deps import MAX_BODY_BYTES, SessionServices, caller_from, services_of
from services.sessions.messages.protocol import PING, error_event
from services.sessions.messages.service import MessagesService
from services.sessions.sse import SSE_HEADERS, StreamKeepAlive
from shared.disconnects import DisconnectWatch
from shared.errors import AxonError
from shared.hot_routes import HotRoute, read_body, send_json
from shared.internal_headers import Caller
from shared.logging import bind_contextvars
from shared.messages_requests import MessageCreate, parse_count_tokens, parse_message_create
from shared.tracing import span

PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


async def _create(scope: Scope, receive: Receive, send: Send) -> None:
    services = services_of(scope)
    caller = caller_from(scope)
    body = parse_message_create(await read_body(scope, receive, max_bytes=MAX_BODY_BYTES))
    if body.metadata is not None and body.metadata.user_id is not None:
        bind_contextvars(user=body.metadata.user_id)
    await services.counted(
        PATH, body.model, _answer(services, body, caller=caller, scope=scope, receive=receive, send=send)
    )


async def _answer(
    services: SessionServices, body: MessageCreate, *, caller: Caller, scope: Scope, receive: Receive, send: Send
) -> int:
    """Run the request and write its Message (whole, or as events with `stream`); returns the status sent."""
    service: MessagesService = services.messages
    active = await service.start(body, caller=caller, request_id=scope["state"]["request_id"])
    watch = DisconnectWatch(scope, receive)
    try:
        keepalive = None
        if body.stream and active.job.start_by is not None:  # queued for a model with no live worker
            keepalive = StreamKeepAlive(send, SSE_HEADERS, beat=PING)
        try:
            with span(services.tracing, "first chunk"):
                first, rest = await service.completions.first_chunk(
                    active, on_wait=keepalive.beat if keepalive else None
                )
        except AxonError as exc:
            if keepalive is None or not keepalive.started:
                raise
            watch.stop()
            await send({"type": "http.response.body", "body": error_event(exc), "more_body": False})
            return 200
        with span(services.tracing, "relay"):
            if not body.stream:
                message = await service.collect(body, active, first, rest)
                watch.stop()
                await send_json(send, 200, orjson.dumps(message))
                return 200
            started = keepalive is not None and keepalive.started
            async for piece in service.stream(body, active, first, rest):
                if not started:  # the head goes out right before the first piece: the gateway reads them together
                    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                    started = True
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            watch.stop()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return 200
    finally:
        watch.stop()


async def _count_tokens(scope: Scope, receive: Receive, send: Send) -> None:
    services = services_of(scope)
    caller = caller_from(scope)
    body = parse_count_tokens(await read_body(scope, receive, max_bytes=MAX_BODY_BYTES))
    watch = DisconnectWatch(scope, receive)
    try:
        counted = await services.messages.count_tokens(body, caller=caller, request_id=scope["state"]["request_id"])
    finally:
        watch.stop()
    await send_json(send, 200, orjson.dumps(counted))


HOT_ROUTES = [HotRoute("POST", PATH, _create), HotRoute("POST", COUNT_TOKENS_PATH, _count_tokens)]
