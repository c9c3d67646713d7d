"""The gateway's work: check the body, admit the caller, forward to the session manager and
relay its answer back unchanged.

Completions, the route every generated token takes, are answered by a plain ASGI handler
(`GatewayService.completion`, installed as a `shared.hot_routes.HotRoute`); the other calls go through
FastAPI (`GatewayService.call`). Both forward with the lean HTTP/1.1 client of `shared/http1.py`.
"""

from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any
from urllib.parse import quote, quote_from_bytes

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import Counter
from starlette.types import Message, Receive, Scope, Send

from services.gateway.admission import Admission, Admitter, ModelAccess
from services.gateway.auth import Authenticator, anthropic_authorization
from shared import internal_headers
from shared.anthropic_errors import anthropic_error_body, anthropic_headers
from shared.disconnects import DisconnectWatch, unless_disconnected
from shared.errors import DeadlineExceeded, FileTooLarge, InvalidRequest, PayloadTooLarge, Unavailable, error_body
from shared.hot_routes import header, read_body, stream_body
from shared.http1 import ConnectError, Http1Client, ReadTimeout, RemoteProtocolError
from shared.http1 import Response as UpstreamResponse
from shared.http_responses import SSE_END
from shared.internal_headers import Caller
from shared.keys import KeyRecord
from shared.logging import bind_contextvars, get_logger
from shared.openai_requests import MAX_CHOICES
from shared.tokens import estimate_tokens
from shared.tracing import TRACE_ID_HEADER, SpanKind, Tracing, span

log = get_logger(__name__)

# Response headers that describe the upstream hop, not the answer.
_HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"date",
        b"server",
        b"x-request-id",
        b"request-id",
        TRACE_ID_HEADER.encode(),
    }
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
    + b"\n\n"
    + SSE_END
)
# The same, ending one of Anthropic's streams (`POST /v1/messages`).
_ANTHROPIC_STREAM_BROKEN_EVENT = (
    b"event: error\ndata: "
    + orjson.dumps(anthropic_error_body("The answer's stream was interrupted; the request may be retried.", status=500))
    + b"\n\n"
)
_UPSTREAM_ERRORS = (ConnectError, ReadTimeout, RemoteProtocolError, OSError)
# What an upload's body may carry beyond its file (`AXON_FILE_MAX_BYTES`): boundaries, part
# heads, the other form fields.
FILE_FORM_OVERHEAD_BYTES = 64 * 1024
# Anthropic's Message Batches: their answers name URLs under the address the client called.
MESSAGE_BATCHES_PATH = "/v1/messages/batches"
# Anthropic's token counting route: admitted as a request, with no tokens.
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
OVERLOADED_MESSAGE = "The gateway is serving as many requests as it can; try again shortly."


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object.

    Raises:
        InvalidRequest: the body is not a JSON object.
    """
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequest("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return parsed


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens estimated from characters, part of what admission charges (`most_tokens`);
    real usage is settled later.

    Each of `n` choices is a job of its own that reads the prompt, so the estimate is charged `n`
    times (an `n` the session manager will refuse counts once).
    """
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
    # A Messages API body's `system` (a string or text blocks; its messages are counted above).
    system = body.get("system")
    if isinstance(system, list):
        chars += sum(len(p["text"]) for p in system if isinstance(p, dict) and isinstance(p.get("text"), str))
    # A Responses API body: `instructions` and `input` (a string, or items with text or output).
    for text in (body.get("instructions"), body.get("input"), system if isinstance(system, str) else None):
        if isinstance(text, str):
            chars += len(text)
            messages += 1
    if isinstance(body.get("input"), list):
        for item in body["input"]:
            messages += 1
            content = item.get("content", item.get("output")) if isinstance(item, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) for p in prompt if isinstance(p, str))
    return estimate_tokens(chars=chars, messages=messages) * _choices(body)


def _choices(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if type(n) is int and 1 <= n <= MAX_CHOICES else 1


def most_tokens(body: dict[str, Any], prompt_estimate: int, *, default_max_tokens: int, limit: int) -> int:
    """The most tokens a completion may use, charged against its key's tokens per minute and
    reserved of its budget at admission: the prompt estimate and `n` times its
    `max_completion_tokens`, `max_tokens` or `max_output_tokens` (else `AXON_DEFAULT_MAX_TOKENS`,
    the session manager's default, which it lowers to half the model's context when that is
    less), at most `AXON_MAX_TOKENS_LIMIT` (the session manager refuses more than that, or than
    the model's context, and the gateway then gives the charge back)."""
    requested = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    max_tokens = requested if type(requested) is int and requested >= 1 else default_max_tokens
    return prompt_estimate + min(max_tokens, limit) * _choices(body)


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


def caller_of(record: KeyRecord, admission: Admission | None = None) -> Caller:
    """Whom the gateway vouches for to the session manager: the key's tenant, priority, id and tokens
    per minute, and what a completion's `admission` charged against them, leased and reserved
    (settled by the session manager when the answer ends)."""
    return Caller(
        tenant=record.tenant,
        priority=record.limits.priority,
        key_id=record.id,
        tpm_limit=record.limits.tpm or 0,
        tpm_charged=admission.tpm_charged if admission else 0,
        lease_id=admission.lease_id if admission else None,
        budget=admission.reservation if admission else None,
    )


def _relayed_headers(upstream: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in upstream.headers if name not in _HOP_HEADERS]


class Forwarder:
    """Requests to the session manager, one keep-alive connection pool per process, each with the
    internal token (the session manager refuses requests without it)."""

    def __init__(self, client: Http1Client, *, internal_token: str) -> None:
        self._client = client
        self._authorization = f"Bearer {internal_token}"

    async def open(
        self, method: str, target: str, *, body: bytes | AsyncIterator[bytes] | None, headers: dict[str, str]
    ) -> UpstreamResponse:
        """Send the request (a body as pieces: streamed as they come); return once the session
        manager's response head has arrived.

        Raises:
            Unavailable: the session manager cannot be reached.
            DeadlineExceeded: it did not answer in time.
        """
        headers["authorization"] = self._authorization
        try:
            if body is None or isinstance(body, bytes):
                return await self._client.request(method, target, headers=headers, body=body)
            return await self._client.stream(method, target, headers=headers.items(), body=body)
        except ReadTimeout as exc:
            raise DeadlineExceeded("The session manager did not answer in time.") from exc
        except _UPSTREAM_ERRORS as exc:
            log.warning("upstream_unreachable", error=repr(exc))
            raise Unavailable("The session manager is unreachable; try again shortly.", retry_after_s=2) from exc


class InFlightLimit:
    """The requests one gateway process forwards at once. Past the limit a request is refused at
    once, before authentication or reading its body: overload costs a few microseconds per
    refused request instead of a queue that times out and grows the process's memory."""

    def __init__(self, limit: int, refused: Counter) -> None:
        self.limit = limit
        self.count = 0
        self._refused = refused

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one of the slots for the duration of the block.

        Raises:
            Unavailable: all slots are taken (503 `overloaded`, Retry-After: 1).
        """
        if self.count >= self.limit:
            self._refused.inc()
            raise Unavailable(OVERLOADED_MESSAGE, retry_after_s=1, code="overloaded")
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1


class GatewayService:
    """Admits each call against its key's limits and forwards it."""

    def __init__(
        self,
        *,
        forwarder: Forwarder,
        authenticator: Authenticator,
        admitter: Admitter,
        model_access: ModelAccess,
        in_flight: InFlightLimit,
        max_body_bytes: int,
        file_max_bytes: int,
        body_timeout_s: float,
        default_max_tokens: int,
        max_tokens_limit: int,
        tracing: Tracing | None = None,
    ) -> None:
        self._tracing = tracing
        self._forwarder = forwarder
        self._authenticator = authenticator
        self._admitter = admitter
        self._model_access = model_access
        self._default_max_tokens = default_max_tokens
        self._max_tokens_limit = max_tokens_limit
        self._in_flight = in_flight
        self._max_body_bytes = max_body_bytes
        self._file_max_bytes = file_max_bytes
        self._body_timeout_s = body_timeout_s

    def _upstream_headers(self, request_id: str, caller: Caller) -> dict[str, str]:
        return {"content-type": "application/json", "x-request-id": request_id, **internal_headers.encode(caller)}

    async def completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`POST /v1/chat/completions` and `/v1/completions` as a plain ASGI handler: take an
        in-flight slot, authenticate, read the body, admit it charging the most tokens it may use,
        forward, relay."""
        with self._in_flight.slot():
            await self._complete(scope, receive, send, anthropic=False)

    async def messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Anthropic's `POST /v1/messages` and `/v1/messages/count_tokens`, as `completion`: the key
        in `x-api-key` (or `Authorization: Bearer`), rate-limit headers under Anthropic's names, a
        broken stream ended with an `error` event (errors take Anthropic's shape by the path)."""
        with self._in_flight.slot():
            await self._complete(scope, receive, send, anthropic=True)

    async def _complete(self, scope: Scope, receive: Receive, send: Send, *, anthropic: bool) -> None:
        tracing = self._tracing
        authorization = header(scope, b"authorization")
        if anthropic:
            authorization = anthropic_authorization(authorization, header(scope, b"x-api-key"))
        with span(tracing, "authenticate"):
            record = await self._authenticator.authenticate(authorization)
        bind_contextvars(tenant=record.tenant, key_id=record.id)
        body = await read_body(scope, receive, max_bytes=self._max_body_bytes, timeout_s=self._body_timeout_s)
        parsed = parse_json_object(body)
        await self._model_access.require(record, parsed.get("model"))
        if anthropic and scope["path"] == COUNT_TOKENS_PATH:
            tokens = 0  # a count generates nothing and is charged no tokens (as Anthropic's): requests only
        else:
            tokens = most_tokens(
                parsed,
                estimate_prompt_tokens(parsed),
                default_max_tokens=self._default_max_tokens,
                limit=self._max_tokens_limit,
            )
        with span(tracing, "admission", attributes={"axon.tokens": tokens}):
            admission = await self._admitter.admit(record, tokens=tokens)
        # The session manager settles what the admission holds when the answer ends.
        headers = self._upstream_headers(scope["state"]["request_id"], caller_of(record, admission))
        handed_over = False
        try:
            watch = DisconnectWatch(scope, receive)
            try:
                with span(tracing, "upstream", kind=SpanKind.CLIENT):
                    if tracing is not None:
                        tracing.inject(headers)
                    upstream = await self._forwarder.open("POST", scope["path"], body=body, headers=headers)
                    rate_headers = admission.headers()
                    try:
                        handed_over = await _relay(
                            upstream,
                            send,
                            watch,
                            extra_headers=anthropic_headers(rate_headers) if anthropic else rate_headers,
                            broken=_ANTHROPIC_STREAM_BROKEN_EVENT if anthropic else _STREAM_BROKEN_EVENT,
                        )
                    finally:
                        upstream.close()
            finally:
                watch.stop()
        finally:
            # An answer relayed to its end had its admission settled by the session manager, in the
            # same write as its usage; in every other case (an error, a broken stream, a client
            # gone) give it back here too: after the session manager's settlement that changes
            # nothing, and one the session manager makes later charges the usage.
            if not handed_over:
                await self._admitter.release(admission)

    async def call(self, request: Request, record: KeyRecord, *, upload: bool = False) -> Response:
        """Forward any other API call (it counts against the key's request limits). A replayed
        event stream, or a file's content, holds its in-flight slot and its admission (the key's
        concurrency lease) until it ends, as a completion stream does. An `upload`'s body (a
        file's, `POST /v1/files`) streams through as it arrives, never held whole."""
        held = AsyncExitStack()
        held.enter_context(self._in_flight.slot())
        try:
            response = await self._call(request, record, held, upload=upload)
        except BaseException:
            await held.aclose()
            raise
        if isinstance(response, _HeldStream):
            response.held = held
        else:
            await held.aclose()
        return response

    async def _call(self, request: Request, record: KeyRecord, held: AsyncExitStack, *, upload: bool) -> Response:
        body: bytes | AsyncIterator[bytes] | None = None
        if upload:
            body = self._upload_pieces(request)
        elif request.method in {"POST", "PUT", "PATCH"}:
            body = await read_body(
                request.scope, request.receive, max_bytes=self._max_body_bytes, timeout_s=self._body_timeout_s
            )
            if body:  # a POST without a body (`/v1/responses/{id}/cancel`) is the session manager's to judge
                parse_json_object(body)
        admission: Admission = await self._admitter.admit(record, tokens=0)
        held.push_async_callback(self._admitter.release, admission)
        headers = self._upstream_headers(request.scope["state"]["request_id"], caller_of(record))
        if upload:
            headers["content-type"] = request.headers.get("content-type", "")
        last_event_id = request.headers.get("last-event-id")
        if last_event_id is not None:  # where a resumed stream (`GET .../stream`) goes on from
            headers["last-event-id"] = last_event_id
        if request.url.path.startswith(MESSAGE_BATCHES_PATH):  # a message batch's `results_url`
            headers[internal_headers.PUBLIC_URL_HEADER] = str(request.base_url).rstrip("/")
        if self._tracing is not None:  # the session manager's span joins the request's trace
            self._tracing.inject(headers)
        opening = self._forwarder.open(request.method, upstream_target(request), body=body, headers=headers)
        # An upload's body is read as it is forwarded: its end (or its client gone) is seen there.
        upstream = await (opening if upload else unless_disconnected(request, opening))
        if upstream.header(b"content-type") == b"application/octet-stream":
            # A file's content: relayed as it comes, with its length (a cut-off download shows).
            held.callback(upstream.close)
            download = _HeldStream(_file_pieces(upstream), status_code=upstream.status)
            download.raw_headers.extend(_relayed_headers(upstream))
            download.raw_headers.append((b"content-length", upstream.header(b"content-length") or b"0"))
            download.headers.update(admission.headers())
            return download
        if (upstream.header(b"content-type") or b"").startswith(b"text/event-stream"):
            # A replayed stream (`GET /v1/responses/{id}?stream=true`): relayed as it comes.
            held.callback(upstream.close)  # also if the stream never starts (its client left)
            streamed = _HeldStream(_event_pieces(upstream), status_code=upstream.status)
            streamed.raw_headers.extend(_relayed_headers(upstream))
            streamed.headers.update(admission.headers())
            return streamed
        try:
            content = await upstream.read()
        except _UPSTREAM_ERRORS as exc:
            raise Unavailable("The session manager's answer was cut off; try again.", retry_after_s=1) from exc
        response = Response(content, status_code=upstream.status)
        response.raw_headers.extend(_relayed_headers(upstream))
        response.headers.update(admission.headers())
        return response

    def _upload_pieces(self, request: Request) -> AsyncIterator[bytes]:
        """An upload's body as it will arrive, refused past the file limit and its form's overhead:
        by its Content-Length here, before anything is forwarded, else as it streams.

        Raises:
            FileTooLarge: the body is declared too large (later, as it streams: it is).
            RequestTimeout (as it streams): nothing arrived for AXON_REQUEST_BODY_TIMEOUT_S.
            ClientGone (as it streams): the client left mid-upload.
        """
        max_bytes = self._file_max_bytes + FILE_FORM_OVERHEAD_BYTES
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise FileTooLarge.over(self._file_max_bytes)
        return self._stream_upload(request, max_bytes=max_bytes)

    async def _stream_upload(self, request: Request, *, max_bytes: int) -> AsyncIterator[bytes]:
        try:
            async for piece in stream_body(request.receive, max_bytes=max_bytes, stall_timeout_s=self._body_timeout_s):
                yield piece
        except PayloadTooLarge:
            raise FileTooLarge.over(self._file_max_bytes) from None


class _HeldStream(StreamingResponse):
    """A replayed event stream that releases what its request holds (`held`: its in-flight slot,
    its admission) once it is over, however it ends."""

    held: AsyncExitStack | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.held is not None:
                await self.held.aclose()


async def _event_pieces(upstream: UpstreamResponse) -> AsyncIterator[bytes]:
    """An event stream's pieces as they arrive; a stream the session manager breaks off just ends
    (its client resumes after the last event it got)."""
    try:
        async for piece in upstream.pieces():
            yield piece
    except _UPSTREAM_ERRORS as exc:
        log.warning("upstream_stream_broken", error=repr(exc))
    finally:
        upstream.close()


async def _file_pieces(upstream: UpstreamResponse) -> AsyncIterator[bytes]:
    """A file's content as it arrives; one the session manager breaks off breaks the download
    too (its client sees fewer bytes than its Content-Length)."""
    try:
        async for piece in upstream.pieces():
            yield piece
    except _UPSTREAM_ERRORS as exc:
        log.warning("upstream_download_broken", error=repr(exc))
        raise
    finally:
        upstream.close()


# The last event of a Responses API stream (`POST /v1/responses` with `stream`) or of a Messages
# API stream (`POST /v1/messages`: `message_stop`, or Anthropic's `error` event), which have no `[DONE]`.
_RESPONSES_ENDS = (
    b"event: response.completed\n",
    b"event: response.incomplete\n",
    b"event: response.failed\n",
    b"event: message_stop\n",
    b'event: error\ndata: {"type":"error","error":',
)


def _stream_end(piece: bytes) -> bool:
    """Whether `piece` ends its stream: chat's `data: [DONE]`, or a whole terminal event of a
    Responses or Messages stream (events end with a blank line, which their JSON data cannot hold)."""
    if piece.endswith(SSE_END):
        return True
    if not piece.endswith(b"\n\n"):
        return False
    last = piece.rfind(b"\n\nevent: ", 0, len(piece) - 2)
    return piece.startswith(_RESPONSES_ENDS, last + 2 if last >= 0 else 0)


async def _relay(
    upstream: UpstreamResponse,
    send: Send,
    watch: DisconnectWatch,
    *,
    extra_headers: dict[str, str],
    broken: bytes = _STREAM_BROKEN_EVENT,
) -> bool:
    """Pass the session manager's answer through: an event stream piece by piece (the piece with
    `[DONE]`, or a Responses or Messages stream's last event, ends the body in the same write),
    anything else whole. A stream the session manager breaks off ends with `broken`, an error
    event (`stream_interrupted`).

    Returns:
        Whether a 200 answer was relayed to its end (the session manager then ended the request's
        bookkeeping itself).
    """
    headers = _relayed_headers(upstream)
    headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in extra_headers.items()]
    if not (upstream.header(b"content-type") or b"").startswith(b"text/event-stream"):
        try:
            content = await upstream.read()
        except _UPSTREAM_ERRORS as exc:
            raise Unavailable("The session manager's answer was cut off; try again.", retry_after_s=1) from exc
        watch.stop()
        headers.append((b"content-length", b"%d" % len(content)))
        await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
        await send({"type": "http.response.body", "body": content})
        return upstream.status == 200
    start: Message | None = {"type": "http.response.start", "status": upstream.status, "headers": headers}
    ended = False
    try:
        async for piece in upstream.pieces():
            if ended:
                continue  # nothing follows the end; reading on returns the connection to the pool
            if start is not None:  # the head goes out right before the first piece: one read for the client
                await send(start)
                start = None
            ended = _stream_end(piece)
            if ended:
                watch.stop()
            await send({"type": "http.response.body", "body": piece, "more_body": not ended})
        if ended:
            return upstream.status == 200
    except _UPSTREAM_ERRORS as exc:
        if ended:
            return upstream.status == 200
        log.warning("upstream_stream_broken", error=repr(exc))
        watch.stop()
        if start is not None:
            await send(start)
        await send({"type": "http.response.body", "body": broken, "more_body": False})
        return False
    watch.stop()
    if start is not None:
        await send(start)
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return False
