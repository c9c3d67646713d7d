"""CPU per request of `shared.http1` (the gateway's client to the session manager) against aiohttp and
httpx, with 100 requests in flight to a local upstream.

    .venv/bin/python benchmarks/micro/http1.py                      # about 25 s
    .venv/bin/python benchmarks/micro/http1.py --calls 2000 --mode json

The upstream (`benchmarks/micro/upstream.py`) runs in a process of its own, so only the client's CPU
is counted. Every request is what the gateway forwards: `POST` of a small chat-completion body (about
120 bytes) with the seven headers the gateway adds (`x-request-id`, `x-axon-tenant`, ...), over
keep-alive connections (up to 100, one per request in flight). Two answers:

- `json`: a small chat completion (about 260 bytes, Content-Length), read whole.
- `sse`: 8 chat-completion chunks as server-sent events (chunked; each event written on its own,
  `[DONE]` with the last), read piece by piece as they arrive, as the gateway relays a stream. How
  many socket reads a stream takes depends on timing (a slower client finds more in each read), so
  this comparison is less exact than `json`.

The contenders, each reading the status, the content type and the body:

- `http1`: `shared.http1.Http1Client` as the gateway builds it (`services/gateway/app.py`) and used
  as its `Forwarder` and relay use it: `request()`, then `read()` or `pieces()`, then `close()`.
- `aiohttp`: one `ClientSession` with a `TCPConnector(limit=100)`; `read()` or `content.iter_any()`.
- `httpx`: one `AsyncClient` with `Limits(max_connections=100, max_keepalive_connections=100)` (its
  default keeps only 20 idle connections, which would reconnect most requests);
  `post()` or `stream()` with `aiter_raw()`.
"""

import argparse
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: `benchmarks.micro` from the repo

import aiohttp
import httpx
import orjson

from benchmarks.micro.common import Comparison, Contender, add_arguments, close_all, compare, report, run
from shared.http1 import Http1Client

UPSTREAM = Path(__file__).with_name("upstream.py")
MODES = ("json", "sse")
BODY = orjson.dumps(
    {
        "model": "bench-model",
        "messages": [{"role": "user", "content": "Say hello in five words."}],
        "max_tokens": 8,
        "stream": False,
    }
)
# What the gateway sends the session manager (GatewayService._upstream_headers, with a lease).
HEADERS = {
    "content-type": "application/json",
    "x-request-id": "6f1c0b8e2a9d4c7fb3e15a0d9c8b7a61",
    "x-axon-tenant": "bench",
    "x-axon-priority": "0",
    "x-axon-key-id": "key_0123456789abcdef",
    "x-axon-tpm-limit": "2000000000",
    "x-axon-tpm-charged": "268",
    "x-axon-lease-id": "a1b2c3d4e5f60718",
}


@contextmanager
def upstream(events: int) -> Iterator[str]:
    """Start the upstream server in a process of its own; yields its base URL."""
    process = subprocess.Popen(
        [sys.executable, str(UPSTREAM), "--port", "0", "--events", str(events)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _checked(status: int, content_type: str, path: str) -> None:
    expected = "text/event-stream" if path == "/sse" else "application/json"
    if status != 200 or not content_type.startswith(expected):
        raise RuntimeError(f"unexpected answer: {status} {content_type}")


def http1_contender(base_url: str, path: str, concurrency: int) -> Contender:
    # As services/gateway/app.py builds it (max idle = the gateway's in-flight limit).
    client = Http1Client(
        base_url, max_idle_connections=concurrency, connect_timeout_s=5.0, read_timeout_s=30.0, idle_timeout_s=2.0
    )

    async def call(_index: int) -> int:
        response = await client.request("POST", path, headers=HEADERS, body=BODY)
        try:
            content_type = (response.header(b"content-type") or b"").decode("latin-1")
            if content_type.startswith("text/event-stream"):
                size = 0
                async for piece in response.pieces():
                    size += len(piece)
            else:
                size = len(await response.read())
            _checked(response.status, content_type, path)
            return size
        finally:
            response.close()

    return Contender("http1", call, client.aclose)


def aiohttp_contender(base_url: str, path: str, concurrency: int) -> Contender:
    session = aiohttp.ClientSession(base_url, connector=aiohttp.TCPConnector(limit=concurrency))
    stream = path == "/sse"

    async def call(_index: int) -> int:
        async with session.post(path, data=BODY, headers=HEADERS) as response:
            if stream:
                size = 0
                async for piece in response.content.iter_any():
                    size += len(piece)
            else:
                size = len(await response.read())
            _checked(response.status, response.headers.get("content-type", ""), path)
            return size

    return Contender("aiohttp", call, session.close)


def httpx_contender(base_url: str, path: str, concurrency: int) -> Contender:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    client = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30.0)

    async def call_json(_index: int) -> int:
        response = await client.post(path, content=BODY, headers=HEADERS)
        _checked(response.status_code, response.headers.get("content-type", ""), path)
        return len(response.content)

    async def call_sse(_index: int) -> int:
        async with client.stream("POST", path, content=BODY, headers=HEADERS) as response:
            size = 0
            async for piece in response.aiter_raw():
                size += len(piece)
            _checked(response.status_code, response.headers.get("content-type", ""), path)
            return size

    return Contender("httpx", call_sse if path == "/sse" else call_json, client.aclose)


FACTORIES: list[Callable[[str, str, int], Contender]] = [http1_contender, aiohttp_contender, httpx_contender]


async def bench(args: argparse.Namespace, base_url: str) -> list[Comparison]:
    comparisons = []
    for mode in args.mode:
        clients = [factory(base_url, f"/{mode}", args.concurrency) for factory in FACTORIES]
        try:
            sizes = [await client.call(0) for client in clients]
            if len(set(sizes)) != 1:
                raise RuntimeError(f"the clients read different {mode} bodies: {sizes} bytes")
            label = "json (POST, small JSON answer)" if mode == "json" else f"sse (POST, {args.events} events streamed)"
            comparisons.append(await compare(label, clients, args))
        finally:
            await close_all(clients)
    return comparisons


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the benchmark and print its report; returns CPU µs per request by comparison and client."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, calls=6_000, warmup=1_000)
    parser.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES), help="answers to measure")
    parser.add_argument("--events", type=int, default=8, help="events per streamed answer (default %(default)s)")
    args = parser.parse_args(argv)
    with upstream(args.events) as base_url:
        comparisons = run(bench(args, base_url), args.loop)
    report(
        "HTTP/1.1 client: the gateway's hop through shared.http1, aiohttp and httpx",
        args,
        ["httptools", "aiohttp", "httpx", "httpcore", "h11"],
        comparisons,
    )
    return {comparison.label: comparison.as_dict() for comparison in comparisons}


if __name__ == "__main__":
    main()
