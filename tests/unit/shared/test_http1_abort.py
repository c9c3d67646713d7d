"""shared.http1.Http1Client.abort: a stopping gateway breaks the responses it still reads, at once."""

import asyncio

import pytest

from shared.http1 import Http1Client, RemoteProtocolError


async def test_abort_breaks_a_response_being_read() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # a stream that goes on

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Http1Client(f"http://127.0.0.1:{port}", max_idle_connections=8, connect_timeout_s=2, read_timeout_s=30)
    try:
        response = await client.request("GET", "/")
        pieces = response.pieces()
        assert await anext(pieces) == b"first"
        asyncio.get_running_loop().call_later(0.1, client.abort)
        with pytest.raises(RemoteProtocolError):
            async with asyncio.timeout(5):
                await anext(pieces)
    finally:
        server.close()
