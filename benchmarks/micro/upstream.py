"""The upstream of `benchmarks/micro/http1.py`: a minimal keep-alive HTTP/1.1 server, run in a process
of its own so its CPU is not counted with the client's.

    .venv/bin/python benchmarks/micro/upstream.py [--port 0] [--events 8]

It prints the port it listens on (one line), then answers every request once its body is in:

- `POST /json`: a small chat completion as JSON, with Content-Length.
- `POST /sse`: `--events` chat-completion chunks as server-sent events, chunked, then `data: [DONE]`.
  Each event is written on its own (one per event-loop iteration, as the session manager relays
  chunks); the last one carries `[DONE]` and the chunked terminator in the same write.

Requests are parsed with httptools on uvloop, so the server stays far ahead of any client measured.
"""

import argparse
import asyncio

import httptools
import orjson
import uvloop

ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-micro",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "bench-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there, how can I help?"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
    }
)
JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nx-request-id: micro\r\n\r\n%s"
    % (len(ANSWER), ANSWER)
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\nx-request-id: micro\r\n\r\n"
)
EVENT = (
    b"data: "
    + orjson.dumps(
        {
            "id": "chatcmpl-micro",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": "bench-model",
            "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}],
        }
    )
    + b"\n\n"
)
DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Upstream(asyncio.Protocol):
    def __init__(self, events: int) -> None:
        self._events = events
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_message_complete(self) -> None:
        transport = self._transport
        if transport is None:
            return
        if self._url == b"/sse":
            self._stream(transport, 0)
        else:
            transport.write(JSON_RESPONSE)

    def _stream(self, transport: asyncio.Transport, sent: int) -> None:
        if transport.is_closing():
            return
        last = sent + 1 >= self._events
        data = chunk(EVENT + DONE) + b"0\r\n\r\n" if last else chunk(EVENT)
        transport.write(SSE_HEAD + data if sent == 0 else data)
        if not last:
            asyncio.get_running_loop().call_soon(self._stream, transport, sent + 1)


async def serve(port: int, events: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Upstream(events), "127.0.0.1", port, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--events", type=int, default=8, help="events per streamed answer ([DONE] rides on the last)")
    args = parser.parse_args()
    uvloop.run(serve(args.port, max(1, args.events)))


if __name__ == "__main__":
    main()
