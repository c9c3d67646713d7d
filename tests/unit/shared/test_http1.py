"""shared.http1.Http1Pool (and so Http1Client) against a scripted raw HTTP server: keep-alive reuse, the idle-close
race, broken responses, unframed bodies and the body sink."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from shared.http1 import ConnectError, Http1Client, Http1Pool, ReadTimeout, RemoteProtocolError


class ThenClose(bytes):
    """An answer after which the server closes the connection."""


# (request number on its connection, request body) -> raw bytes to send, or None to close at once
Script = Callable[[int, bytes], Awaitable[bytes | None]]


@dataclass
class RawServer:
    url: str
    connections: int = 0
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)  # (head, body)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    return head, await reader.readexactly(length)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Awaitable[RawServer]]]:
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> RawServer:
        state = RawServer(url="")

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            state.connections += 1
            try:
                for number in range(1_000):
                    head, body = await read_request(reader)
                    state.requests.append((head, body))
                    answer = await script(number, body)
                    if answer is None:
                        return
                    writer.write(answer)
                    await writer.drain()
                    if isinstance(answer, ThenClose):
                        return
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions?x=1"
        return state

    yield start
    for server in servers:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 5)


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def chunked(*parts: bytes, status: bytes = b"200 OK") -> bytes:
    out = b"HTTP/1.1 " + status + b"\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return out + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def pool(url: str, **kwargs: object) -> Http1Pool:
    options = {"headers": {"Authorization": "Bearer k"}, "max_idle_connections": 4, "connect_timeout_s": 5.0}
    return Http1Pool(url, **{**options, **kwargs})  # type: ignore[arg-type]


async def test_posts_reuse_one_keep_alive_connection_and_send_a_proper_request(serve) -> None:
    async def echo(_number: int, body: bytes) -> bytes:
        return ok(body)

    server = await serve(echo)
    client = pool(server.url)
    try:
        for i in range(5):
            assert await client.post(b'{"n": %d}' % i) == (200, b'{"n": %d}' % i)
    finally:
        await client.aclose()
    assert server.connections == 1
    head = server.requests[0][0].decode()
    assert head.startswith("POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
    assert "Host: 127.0.0.1:" in head and "Authorization: Bearer k" in head and "Content-Length: 8" in head


async def test_a_keep_alive_connection_the_server_dropped_is_retried_once(serve) -> None:
    async def close_on_second(number: int, body: bytes) -> bytes | None:
        return None if number == 1 else ok(body)  # as a server whose idle timeout just expired

    server = await serve(close_on_second)
    client = pool(server.url)
    try:
        assert await client.post(b"a") == (200, b"a")
        assert await client.post(b"b") == (200, b"b")
    finally:
        await client.aclose()
    assert server.connections == 2


@pytest.mark.parametrize("cut_at", [0, 40, -10])
async def test_a_response_cut_short_is_a_protocol_error(serve, cut_at: int) -> None:
    async def cut(_number: int, _body: bytes) -> bytes | None:
        return ThenClose(chunked(b"data: 1\n\n")[:cut_at]) if cut_at else None

    server = await serve(cut)
    received: list[bytes] = []
    client = pool(server.url)
    try:
        with pytest.raises(RemoteProtocolError, match="closed the connection before the response ended"):
            await asyncio.wait_for(client.post(b"x", sink=lambda data, _t: received.append(data)), 5)
    finally:
        await client.aclose()
    assert server.connections == 1  # a fresh connection is not retried


async def test_garbage_is_a_protocol_error(serve) -> None:
    async def garbage(_number: int, _body: bytes) -> bytes:
        return ThenClose(b"SSH-2.0-OpenSSH_9.6\r\n")

    server = await serve(garbage)
    client = pool(server.url)
    try:
        with pytest.raises(RemoteProtocolError, match="invalid HTTP response"):
            await asyncio.wait_for(client.post(b"x"), 5)
    finally:
        await client.aclose()


async def test_sink_gets_a_200_body_as_it_arrives_but_not_an_error_body(serve) -> None:
    async def answer(_number: int, body: bytes) -> bytes:
        if body == b"bad":
            return chunked(b'{"error": {"message": "slow down"}}', status=b"429 Too Many Requests")
        return chunked(b"data: 1\n\n", b"data: 2\n\n")

    server = await serve(answer)
    received: list[bytes] = []
    client = pool(server.url)
    try:
        assert await client.post(b"good", sink=lambda data, _t: received.append(data)) == (200, b"")
        assert b"".join(received) == b"data: 1\n\ndata: 2\n\n"
        received.clear()
        status, body = await client.post(b"bad", sink=lambda data, _t: received.append(data))
    finally:
        await client.aclose()
    assert (status, body, received) == (429, b'{"error": {"message": "slow down"}}', [])


async def test_an_unframed_body_ends_when_the_server_closes(serve) -> None:
    async def unframed(_number: int, _body: bytes) -> bytes:
        return ThenClose(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")

    server = await serve(unframed)
    client = pool(server.url)
    try:
        assert await asyncio.wait_for(client.post(b"x"), 5) == (200, b"all of it")
    finally:
        await client.aclose()


async def test_connection_refused_is_a_connect_error() -> None:
    client = pool("http://127.0.0.1:9/v1/completions")
    with pytest.raises(ConnectError):
        await client.post(b"x")


def test_only_plain_http_urls_are_supported() -> None:
    assert Http1Pool.supports("http://127.0.0.1:8000/v1/completions")
    assert not Http1Pool.supports("https://api.example.com/v1/completions")
    with pytest.raises(ValueError):
        pool("https://api.example.com/v1")


def client_for(url: str, **kwargs: object) -> Http1Client:
    options = {"max_idle_connections": 4, "connect_timeout_s": 5.0}
    return Http1Client(url.split("/v1")[0], **{**options, **kwargs})  # type: ignore[arg-type]


async def test_a_streamed_body_arrives_in_pieces_as_it_is_sent() -> None:
    release = asyncio.Event()

    # A server that sends the head and one event, waits, then the rest: the first piece must
    # reach the caller before the rest is sent.
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        await writer.drain()

    streaming = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = client_for(f"http://127.0.0.1:{streaming.sockets[0].getsockname()[1]}", read_timeout_s=5)
    try:
        response = await client.request("POST", "/v1/chat/completions", headers={"x-a": "1"}, body=b"{}")
        assert response.status == 200 and response.header(b"content-type") == b"text/event-stream"
        pieces = response.pieces()
        assert await anext(pieces) == b"data: 1\n\n"
        release.set()
        assert [piece async for piece in pieces] == [b"data: 2\n\n"]
    finally:
        await client.aclose()
        streaming.close()


async def test_a_silent_server_times_out_on_the_head_and_mid_body() -> None:
    async def silent_after_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/body" in head:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await writer.drain()
        await asyncio.sleep(10)

    server = await asyncio.start_server(silent_after_head, "127.0.0.1", 0)
    client = client_for(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", read_timeout_s=0.2)
    try:
        with pytest.raises(ReadTimeout):
            await client.request("GET", "/head")
        response = await client.request("GET", "/body")
        with pytest.raises(ReadTimeout):
            await response.read()
    finally:
        await client.aclose()
        server.close()


async def test_the_read_timeout_counts_from_the_last_piece_not_the_first() -> None:
    """Pieces 0.15 s apart for 0.6 s, with a read timeout of 0.3 s, all arrive; then 1 s of
    silence is a ReadTimeout."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(4):
            await asyncio.sleep(0.15)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
        await asyncio.sleep(10)

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    client = client_for(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", read_timeout_s=0.3)
    received = b""
    try:
        response = await client.request("GET", "/trickle")
        with pytest.raises(ReadTimeout):
            async for piece in response.pieces():
                received += piece
        assert received == b"xxxx"
    finally:
        await client.aclose()
        server.close()


async def test_an_idle_connection_past_its_timeout_is_not_reused(serve) -> None:
    async def echo(_number: int, body: bytes) -> bytes:
        return ok(body)

    server = await serve(echo)
    client = client_for(server.url, idle_timeout_s=0.1)
    try:
        assert await (await client.request("POST", "/v1/x", body=b"a")).read() == b"a"
        assert await (await client.request("POST", "/v1/x", body=b"b")).read() == b"b"
        await asyncio.sleep(0.2)
        assert await (await client.request("POST", "/v1/x", body=b"c")).read() == b"c"
    finally:
        await client.aclose()
    assert server.connections == 2


async def _pieces(*pieces: bytes) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return body
        body += chunk[:-2]


async def test_a_streamed_request_body_goes_chunked_and_the_connection_is_reused() -> None:
    received: list[tuple[bytes, bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = await _read_chunked(reader) if b"chunked" in head.lower() else b""
                received.append((head, body))
                answer = b"%d" % len(body)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Http1Client(f"http://127.0.0.1:{port}", max_idle_connections=4, connect_timeout_s=5, read_timeout_s=5)
    try:
        big = b"x" * (3 * 1024 * 1024)  # more than the socket takes at once: written as it drains
        response = await client.stream("POST", "/up", headers=[("x-a", "1")], body=_pieces(b"ab", b"", big, b"c"))
        assert response.status == 200 and await response.read() == b"%d" % (len(big) + 3)
        head, body = received[0]
        assert head.startswith(b"POST /up HTTP/1.1\r\n") and b"transfer-encoding: chunked" in head.lower()
        assert body == b"ab" + big + b"c"
        # Read to its end, the connection is kept for the next request.
        follow = await client.request("GET", "/next")
        assert follow.status == 200 and await follow.read() == b"0"
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_an_answer_before_the_whole_body_stops_the_sending_and_is_the_response() -> None:
    sent_after_answer = asyncio.Event()

    async def refuse_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno")
        await writer.drain()
        writer.close()

    async def endless() -> AsyncIterator[bytes]:
        for _ in range(10_000):
            yield b"y" * 65536
            await asyncio.sleep(0.001)
        sent_after_answer.set()  # never reached: the client stops once the answer is in

    server = await asyncio.start_server(refuse_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Http1Client(f"http://127.0.0.1:{port}", max_idle_connections=4, connect_timeout_s=5, read_timeout_s=5)
    try:
        response = await asyncio.wait_for(client.stream("POST", "/up", headers=[], body=endless()), 30)
        assert response.status == 413 and await response.read() == b"no"
        assert not sent_after_answer.is_set()
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_a_body_that_fails_closes_the_connection() -> None:
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client closes
        closed.set()
        writer.close()

    async def broken() -> AsyncIterator[bytes]:
        yield b"part"
        raise ValueError("the client's body broke")

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Http1Client(f"http://127.0.0.1:{port}", max_idle_connections=4, connect_timeout_s=5, read_timeout_s=5)
    try:
        with pytest.raises(ValueError, match="broke"):
            await client.stream("POST", "/up", headers=[], body=broken())
        await asyncio.wait_for(closed.wait(), 10)
    finally:
        server.close()
        await server.wait_closed()
