"""CPU per request of a plain-ASGI `shared.hot_routes.HotRoute` (through `HotRoutes`) against the same answer
from a FastAPI route, with 100 requests in flight, in process.

    .venv/bin/python benchmarks/micro/hot_routes.py                 # about 15 s
    .venv/bin/python benchmarks/micro/hot_routes.py --calls 5000 --mode json

No network and no server: the ASGI app is called directly with the scope uvicorn would build
(`spec_version` 2.3, as uvicorn's httptools protocol sends), a `receive` that hands over the body and
then waits (as for a client that stays connected) and a `send` that keeps the messages. What is
measured is what the app does per request. One FastAPI app holds both, built as the services build
theirs (`telemetry` off, the project's error handlers, `HotRoutes` as middleware), so both go
through the same Starlette middleware stack; `RequestContextMiddleware` (request id, access log,
metrics) is left out, as it costs both the same.

Both do the same work as the session manager's completion route, less the service: read the caller
from the gateway's headers (`caller_from`; in the FastAPI route through the session manager's own
dependency `CallerDep`, as its FastAPI routes take it), parse the body into the session manager's
model (`ChatCompletionRequest`, pydantic), wait for the service once per chunk (here one trip
through the event loop, `next_chunk`, so the 100 requests are really in flight together) while
watching for a client disconnect, and answer with the same bytes (checked before measuring). The
hot routes do it as `services/sessions/chat/router.py`'s handlers do; the FastAPI routes as that
file did before the hot routes (commit 42ee1e9's parent), less the service and metrics:

- `json`: a chat completion as JSON. Hot: `read_body`, `model_validate_json`, a `DisconnectWatch`
  (one watcher task per request), the wait, `send_json` of `orjson.dumps(answer)`. FastAPI: the
  model as the body parameter, `CallerDep` and the `Request`, the wait through
  `shared.disconnects.unless_disconnected` (a task and a poll timer per request), an `ORJSONResponse`.
- `sse`: 8 server-sent events, `[DONE]` with the last, a wait before each. Hot: a `DisconnectWatch`,
  the head and each piece sent by the handler. FastAPI: the first wait through
  `unless_disconnected`, then `SSEResponse` (below) over an async generator (Starlette runs it in
  a task group beside a task listening for the disconnect).
"""

import argparse
import asyncio
import sys
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: `benchmarks.micro` from the repo

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Message, Receive, Scope, Send

from benchmarks.micro.common import Comparison, Contender, add_arguments, compare, report, run
from services.sessions.deps import CallerDep, caller_from
from shared.disconnects import DisconnectWatch, unless_disconnected
from shared.hot_routes import HotRoute, HotRoutes, read_body, send_json
from shared.http_errors import install_error_handlers
from shared.http_responses import SSE_END, ORJSONResponse
from shared.internal_headers import Caller
from shared.middleware import NO_FASTAPI_TELEMETRY
from shared.openai_requests import ChatCompletionRequest

MODES = ("json", "sse")
MAX_BODY_BYTES = 64 * 1024 * 1024
BODY = orjson.dumps(
    {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in five words."},
        ],
        "max_tokens": 8,
        "temperature": 0.0,
    }
)
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


# The streaming response the session manager used before its completion routes became hot routes.
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


def answer(body: ChatCompletionRequest, caller: Caller, request_id: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}",
        "system_fingerprint": f"fp_{caller.tenant}",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": body.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there, how can I help?"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
    }


def events(body: ChatCompletionRequest, caller: Caller, request_id: str, count: int) -> list[bytes]:
    """The answer's pieces: `count` events, `[DONE]` joined to the last (as the session manager sends it)."""
    chunk = b"data: " + orjson.dumps(
        {
            "id": f"chatcmpl-{request_id}",
            "system_fingerprint": f"fp_{caller.tenant}",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": body.model,
            "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}],
        }
    )
    pieces = [chunk + b"\n\n" for _ in range(count)]
    pieces[-1] += SSE_END
    return pieces


async def next_chunk() -> None:
    """Stands in for waiting on the service (the next chunk from Redis pub/sub): one trip through the
    event loop, so the 100 requests really are in flight together and the disconnect watchers run."""
    await asyncio.sleep(0)


def _parse(body: bytes) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(body)


def create_app(event_count: int) -> FastAPI:
    """One app with both: hot routes under /hot/..., FastAPI routes under /fastapi/..."""

    async def hot_json(scope: Scope, receive: Receive, send: Send) -> None:
        caller = caller_from(scope)
        body = _parse(await read_body(scope, receive, max_bytes=MAX_BODY_BYTES))
        watch = DisconnectWatch(scope, receive)
        try:
            await next_chunk()
            payload = orjson.dumps(answer(body, caller, scope["state"]["request_id"]))
            watch.stop()
            await send_json(send, 200, payload)
        finally:
            watch.stop()

    async def hot_sse(scope: Scope, receive: Receive, send: Send) -> None:
        caller = caller_from(scope)
        body = _parse(await read_body(scope, receive, max_bytes=MAX_BODY_BYTES))
        watch = DisconnectWatch(scope, receive)
        try:
            started = False
            for piece in events(body, caller, scope["state"]["request_id"], event_count):
                await next_chunk()
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                    started = True
                ended = piece.endswith(SSE_END)
                if ended:
                    watch.stop()
                await send({"type": "http.response.body", "body": piece, "more_body": not ended})
        finally:
            watch.stop()

    app = FastAPI(telemetry=NO_FASTAPI_TELEMETRY)
    install_error_handlers(app)
    app.add_middleware(
        HotRoutes,
        routes=[
            HotRoute("POST", "/hot/v1/chat/completions", hot_json),
            HotRoute("POST", "/hot/v1/chat/completions/sse", hot_sse),
        ],
    )

    @app.post("/fastapi/v1/chat/completions")
    async def fastapi_json(body: ChatCompletionRequest, caller: CallerDep, request: Request) -> ORJSONResponse:
        await unless_disconnected(request, next_chunk())
        return ORJSONResponse(answer(body, caller, request.state.request_id))

    @app.post("/fastapi/v1/chat/completions/sse")
    async def fastapi_sse(body: ChatCompletionRequest, caller: CallerDep, request: Request) -> SSEResponse:
        await unless_disconnected(request, next_chunk())  # the first chunk, before the response starts
        first, *rest = events(body, caller, request.state.request_id, event_count)

        async def pieces() -> AsyncIterator[bytes]:
            yield first
            for piece in rest:
                await next_chunk()
                yield piece

        return SSEResponse(pieces(), headers={"cache-control": "no-cache"})

    return app


class Exchange:
    """One request driven through the app: the scope, a `receive` that gives the body and then waits
    (a client still connected) and a `send` that keeps every message."""

    def __init__(self, path: str, body: bytes) -> None:
        self.scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "server": ("127.0.0.1", 8001),
            "client": ("127.0.0.1", 50_000),
            "scheme": "http",
            "method": "POST",
            "root_path": "",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1:8001"),
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                # what the gateway forwards (GatewayService._upstream_headers)
                (b"x-request-id", b"6f1c0b8e2a9d4c7fb3e15a0d9c8b7a61"),
                (b"x-axon-tenant", b"bench"),
                (b"x-axon-priority", b"0"),
                (b"x-axon-key-id", b"key_0123456789abcdef"),
                (b"x-axon-tpm-limit", b"2000000000"),
                (b"x-axon-tpm-charged", b"268"),
                (b"x-axon-lease-id", b"a1b2c3d4e5f60718"),
            ],
            # RequestContextMiddleware puts the request id here (left out: it costs both the same)
            "state": {"request_id": "6f1c0b8e2a9d4c7fb3e15a0d9c8b7a61"},
        }
        self._body = body
        self._sent_body = False
        self.messages: list[Message] = []

    async def receive(self) -> Message:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await asyncio.Future()  # the client stays connected: never returns (cancelled when the answer ends)
        raise AssertionError("unreachable")

    async def send(self, message: Message) -> None:
        self.messages.append(message)

    def result(self) -> tuple[int, bytes]:
        """The status and the whole body sent."""
        status = next(m["status"] for m in self.messages if m["type"] == "http.response.start")
        return status, b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def contender(app: FastAPI, name: str, path: str) -> Contender:
    async def call(_index: int) -> tuple[int, bytes]:
        exchange = Exchange(path, BODY)
        await app(exchange.scope, exchange.receive, exchange.send)
        return exchange.result()

    return Contender(name, call)


async def bench(args: argparse.Namespace) -> list[Comparison]:
    app = create_app(args.events)
    comparisons = []
    for mode in args.mode:
        suffix = "/sse" if mode == "sse" else ""
        contenders = [
            contender(app, "HotRoute", f"/hot/v1/chat/completions{suffix}"),
            contender(app, "FastAPI", f"/fastapi/v1/chat/completions{suffix}"),
        ]
        results = [await c.call(0) for c in contenders]
        if len(set(results)) != 1 or not isinstance(results[0], tuple) or results[0][0] != 200:
            raise RuntimeError(f"the routes answer differently: {results!r}")
        label = "json (small JSON in and out)" if mode == "json" else f"sse (JSON in, {args.events} events out)"
        comparisons.append(await compare(label, contenders, args))
    return comparisons


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the benchmark and print its report; returns CPU µs per request by comparison and route."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, calls=30_000, warmup=2_000)
    parser.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES), help="answers to measure")
    parser.add_argument("--events", type=int, default=8, help="events per streamed answer (default %(default)s)")
    args = parser.parse_args(argv)
    comparisons = run(bench(args), args.loop)
    report(
        "ASGI in process: a HotRoute through HotRoutes against a FastAPI route",
        args,
        ["fastapi", "starlette", "pydantic"],
        comparisons,
    )
    return {comparison.label: comparison.as_dict() for comparison in comparisons}


if __name__ == "__main__":
    main()
