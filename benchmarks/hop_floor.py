"""The floor under issue 40's third figure: the CPU per token of three processes that carry each
token the way Axon's three services do, and do nothing else.

    .venv/bin/python benchmarks/hop_floor.py                   # 64 streams, 10 s a style; about 25 s
    .venv/bin/python benchmarks/hop_floor.py --streams 32 --seconds 20

A token's way through the platform (docs/architecture.md): the worker publishes it on its job's
Redis channel (a command written, its reply read), the session manager reads it from its
subscription and writes it as a server-sent event, in an HTTP/1.1 chunk, on the stream's connection
from the gateway, and the gateway reads that and writes it on the client's connection. Here three
uvloop processes do those reads and writes and nothing else per token: no JSON parsed, no timer
armed per token, no metric counted, no progress recorded, no TLS.

- worker: every stream sends a token every `--itl-ms`, the streams spread evenly over the interval
  (as `engine_vs_stack.py` starts the simulator's streams 41 ms apart): `PUBLISH <the stream's
  channel> <a text chunk as services/worker/chunk_publisher.py writes it>` on one Redis connection.
- session manager: one Redis connection subscribed to every stream's channel; each message read and
  written, in a chat-completion chunk's bytes put around the worker's text without parsing it, as one
  HTTP chunk on the stream's connection from the gateway.
- gateway: for every client connection one connection to the session manager, every byte read from
  it written to the client unchanged.
- client (not counted): one connection a stream; it counts the events and ends the run when all came.

Two styles, each in a run of its own:

- `callbacks`: the least an asyncio program can do. Every token is handled in protocol callbacks
  (`data_received`, a `call_at` timer per stream in the worker) and written at once: no task runs.
- `tasks`: the services' shape. Every stream has a task in each process that is woken for each token:
  the worker's sleeps until the token is due and awaits its publish's reply (`shared.redis_pipe.
  RedisPipe`, the worker's own client); the session manager's and the gateway's await the stream's
  next piece from a queue that the connection's callback fills, and write it.

It prints each process's CPU milliseconds per token (user + system, from `/proc`; the worker's from
`time.process_time()` around its streams, as it exits when done) and the three together, beside
issue 40's target for the services (0.06 ms). `engine_vs_stack.py --engine sim` prints the stack's
own figure under the same load, where each service also does its real work (parsing, timeouts,
metrics, the progress record, the simulator in the worker).
"""

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `benchmarks` from the repo

import hiredis
import uvloop

from benchmarks.harness import cpu_seconds
from services.cli.launcher import free_port
from shared.redis_pipe import Endpoint, RedisPipe, pack

TARGET_MS = 0.06
HOST = "127.0.0.1"
# A text chunk as the worker publishes it, and a chat-completion chunk as the session manager
# writes one (its `created` and id fixed).
WORKER_CHUNK = b'{"seq":%d,"text":" word","n_tokens":1}'
EVENT = (
    b'data: {"id":"chatcmpl-4f7c0b9e2d1a4c8e9b3f6a5d7e8c9b0a","object":"chat.completion.chunk",'
    b'"created":1764490000,"model":"sim","choices":[{"index":0,"delta":{"content":%b},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
RESPONSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def tokens_per_stream(args: argparse.Namespace) -> int:
    return int(args.seconds * 1000 / args.itl_ms)


def channel(run: str, stream: int) -> bytes:
    return f"axon_floor_{run}:{stream}".encode()


class Replies(asyncio.Protocol):
    """Reads Redis's replies and hands each to `on_reply`."""

    def __init__(self, on_reply: Callable[[Any], None] | None = None) -> None:
        self._reader = hiredis.Reader()
        self._on_reply = on_reply

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            if self._on_reply is not None:
                self._on_reply(reply)


async def redis_connection(url: str, protocol: Replies) -> asyncio.Transport:
    """A connection to Redis with its `AUTH`/`SELECT` sent (their replies go to `protocol` too)."""
    endpoint = Endpoint(url)
    transport, _ = await endpoint.connect(lambda: protocol, timeout_s=5.0)
    for command in endpoint.setup:
        transport.write(pack(command))
    return transport


async def worker(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    itl_s, ticks = args.itl_ms / 1000, tokens_per_stream(args)
    channels = [channel(args.run, k) for k in range(args.streams)]
    start = loop.time() + 0.05
    cpu = time.process_time()
    if args.style == "tasks":
        pipe = RedisPipe(args.redis_url, timeout_s=5.0)

        async def stream(k: int) -> None:
            for seq in range(ticks):
                await asyncio.sleep(start + (k / args.streams + seq) * itl_s - loop.time())
                await pipe.execute(b"PUBLISH", channels[k], WORKER_CHUNK % seq)

        await asyncio.gather(*(stream(k) for k in range(args.streams)))
        await pipe.aclose()
    else:
        transport = await redis_connection(args.redis_url, Replies())
        left = args.streams
        done = loop.create_future()

        def tick(k: int, seq: int) -> None:
            nonlocal left
            transport.write(pack((b"PUBLISH", channels[k], WORKER_CHUNK % seq)))
            if seq + 1 < ticks:
                loop.call_at(start + (k / args.streams + seq + 1) * itl_s, tick, k, seq + 1)
                return
            left -= 1
            if not left:
                done.set_result(None)

        for k in range(args.streams):
            loop.call_at(start + k / args.streams * itl_s, tick, k, 0)
        await done
        await asyncio.sleep(0.2)  # the last replies
    print(f"cpu {time.process_time() - cpu}", flush=True)


Deliver = Callable[[bytes], None]
_drains: set[asyncio.Task[None]] = set()


def deliver(style: str, transport: asyncio.Transport) -> Deliver:
    """How a process hands a stream's piece to `transport`: written at once (`callbacks`), or put
    in a queue that a task of the stream's own awaits and writes from (`tasks`)."""
    if style == "callbacks":
        return transport.write
    queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def drain() -> None:
        while True:
            transport.write(await queue.get())

    task = asyncio.get_running_loop().create_task(drain())
    _drains.add(task)
    return queue.put_nowait


class FromGateway(asyncio.Protocol):
    """The session manager's side of one stream's connection: its first line names the stream."""

    def __init__(self, routes: dict[bytes, Deliver], args: argparse.Namespace) -> None:
        self._routes, self._args = routes, args

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        stream = channel(self._args.run, int(data.split(b"\n", 1)[0]))
        self._routes[stream] = deliver(self._args.style, self._transport)
        self._transport.write(RESPONSE_HEAD)


async def sessions(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    routes: dict[bytes, Deliver] = {}
    subscribed = loop.create_future()

    def on_reply(reply: Any) -> None:
        if not isinstance(reply, list):
            return  # AUTH's or SELECT's
        kind, name, payload = reply
        if kind == b"message":
            text = payload[payload.index(b'"text":') + 7 : payload.rindex(b',"n_tokens"')]
            event = EVENT % text
            routes[name](b"%x\r\n%b\r\n" % (len(event), event))
        elif kind == b"subscribe" and payload == args.streams:
            subscribed.set_result(None)

    transport = await redis_connection(args.redis_url, Replies(on_reply))
    transport.write(pack((b"SUBSCRIBE", *(channel(args.run, k) for k in range(args.streams)))))
    await subscribed
    server = await loop.create_server(lambda: FromGateway(routes, args), HOST, args.sessions_port)
    print("ready", flush=True)
    await server.serve_forever()


class Relay(asyncio.Protocol):
    """Hands every byte it reads to `to`."""

    def __init__(self, to: Deliver) -> None:
        self._to = to

    def data_received(self, data: bytes) -> None:
        self._to(data)


class FromClient(asyncio.Protocol):
    """The gateway's side of one client connection: opens the stream's connection to the session
    manager on the request and relays its answer."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        asyncio.get_running_loop().create_task(self._open(data))

    async def _open(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        to = deliver(self._args.style, self._transport)
        upstream, _ = await loop.create_connection(lambda: Relay(to), HOST, self._args.sessions_port)
        upstream.write(request)


async def gateway(args: argparse.Namespace) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: FromClient(args), HOST, args.gateway_port)
    print("ready", flush=True)
    await server.serve_forever()


@dataclass
class Tally:
    """What the client has received: every stream's answer begun (`opened`), every event (`done`)."""

    streams: int
    total: int
    opened: asyncio.Future[None]
    done: asyncio.Future[None]
    answered: int = 0
    events: int = 0


class Sink(asyncio.Protocol):
    """One stream's connection of the client: counts the events read from it."""

    def __init__(self, tally: Tally) -> None:
        self._tally = tally
        self._answered = False
        # An event's `data: ` split between two reads is counted once whole.
        self._tail = b""

    def data_received(self, data: bytes) -> None:
        tally = self._tally
        if not self._answered:
            self._answered = True
            tally.answered += 1
            if tally.answered == tally.streams:
                tally.opened.set_result(None)
        data = self._tail + data
        self._tail = data[-5:]
        tally.events += data.count(b"data: ")
        if tally.events >= tally.total and not tally.done.done():
            tally.done.set_result(None)


async def client(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    tally = Tally(args.streams, args.streams * tokens_per_stream(args), loop.create_future(), loop.create_future())
    for k in range(args.streams):
        transport, _ = await loop.create_connection(lambda: Sink(tally), HOST, args.gateway_port)
        transport.write(b"%d\n" % k)
    await asyncio.wait_for(tally.opened, 10)
    print("ready", flush=True)
    await asyncio.wait_for(tally.done, args.seconds + 30)
    print(f"events {tally.events}", flush=True)


STYLES = ("callbacks", "tasks")
ROLES = {"worker": worker, "sessions": sessions, "gateway": gateway, "client": client}


def start(role: str, forwarded: list[str]) -> subprocess.Popen[str]:
    """Start `role` in a process of its own; for a server, wait until it says it is ready."""
    process = subprocess.Popen(
        [sys.executable, __file__, "--role", role, *forwarded], stdout=subprocess.PIPE, text=True
    )
    if role != "worker":
        line = process.stdout.readline() if process.stdout is not None else ""
        if line.strip() != "ready":
            raise SystemExit(f"the {role} process did not start (it said {line!r})")
    return process


SERVICES = ("worker", "sessions", "gateway")


def measure(args: argparse.Namespace, style: str) -> tuple[int, dict[str, float]]:
    """One run of the hops in `style`: the tokens the client received and each process's CPU seconds."""
    forwarded = [
        f"--style={style}",
        f"--streams={args.streams}",
        f"--itl-ms={args.itl_ms}",
        f"--seconds={args.seconds}",
        f"--redis-url={args.redis_url}",
        f"--run={os.getpid()}{style}",
        f"--sessions-port={free_port()}",
        f"--gateway-port={free_port()}",
    ]
    processes: list[subprocess.Popen[str]] = []
    try:
        for role in ("sessions", "gateway", "client"):
            processes.append(start(role, forwarded))
        servers = {"sessions": processes[0].pid, "gateway": processes[1].pid}
        before = {name: cpu_seconds(pid) or 0.0 for name, pid in servers.items()}
        worker_out, _ = start("worker", forwarded).communicate(timeout=args.seconds + 60)
        client_out, _ = processes[2].communicate(timeout=30)
        after = {name: cpu_seconds(pid) or 0.0 for name, pid in servers.items()}
    finally:
        for process in processes:
            process.kill()
            process.wait()
    if processes[2].returncode != 0 or not client_out.startswith("events"):
        raise SystemExit(f"the client did not receive every token ({style}): it said {client_out!r}")
    cpu = {"worker": float(worker_out.split()[-1])} | {name: after[name] - before[name] for name in servers}
    return int(client_out.split()[-1]), cpu


def orchestrate(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Measure both styles and print the table; returns style -> process -> CPU ms per token."""
    results = {style: measure(args, style) for style in STYLES}
    tokens = {style: result[0] for style, result in results.items()}
    print(
        f"hop floor: {args.streams} streams, a token every {args.itl_ms:g} ms each, {args.seconds:g} s; "
        f"tokens received {', '.join(f'{style} {count:,}' for style, count in tokens.items())}; "
        f"uvloop {version('uvloop')}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    print("CPU ms per token  " + "".join(f"{style:>10}" for style in STYLES))
    per_token = {
        style: {name: cpu * 1000 / tokens[style] for name, cpu in results[style][1].items()} for style in STYLES
    }
    for name in SERVICES:
        print(f"{name:<17} " + "".join(f"{per_token[style][name]:>10.4f}" for style in STYLES))
    print(f"{'the three':<17} " + "".join(f"{sum(per_token[style].values()):>10.4f}" for style in STYLES))
    print(f"issue 40's target for the three services: {TARGET_MS}")
    return per_token


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]] | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams (default 64)")
    parser.add_argument("--itl-ms", type=float, default=20.0, help="a stream's time between tokens (default 20)")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the tokens flow (default 10)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--style", choices=STYLES, default="callbacks", help=argparse.SUPPRESS)
    parser.add_argument("--run", default="", help=argparse.SUPPRESS)
    parser.add_argument("--sessions-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gateway-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is None:
        return orchestrate(args)
    uvloop.run(ROLES[args.role](args))
    return None


if __name__ == "__main__":
    main()
