"""A TCP proxy a test can cut and restore, to take a dependency 'down' for one process only
(the shared PostgreSQL server keeps running for everyone else)."""

import asyncio
import contextlib
import threading
from urllib.parse import urlsplit

from services.cli.launcher import free_port


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target; `cut()` drops every connection and refuses new
    ones until `restore()`."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.port = free_port()
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @classmethod
    def to(cls, url: str) -> "TcpProxy":
        """A started proxy to the server `url` names (a service URL of this run: local or a container)."""
        parts = urlsplit(url)
        assert parts.hostname and parts.port, f"{url} names no host and port"
        return cls(parts.hostname, parts.port).start()

    def proxied(self, url: str) -> str:
        """`url` (credentials, database and all) through this proxy."""
        parts = urlsplit(url)
        credentials = parts.netloc.rpartition("@")[0]
        netloc = f"{credentials}@127.0.0.1:{self.port}" if credentials else f"127.0.0.1:{self.port}"
        return parts._replace(netloc=netloc).geturl()

    def start(self) -> "TcpProxy":
        self._thread.start()
        self._call(self._listen())
        return self

    def cut(self) -> None:
        self._call(self._cut())

    def restore(self) -> None:
        self._call(self._listen())

    def close(self) -> None:
        """Drops every connection, waits for their tasks to end, then stops and closes the loop: a
        task left pending is destroyed with the loop at some later garbage collection, whose
        "Task was destroyed but it is pending!" then lands in whatever test runs at that moment."""
        self._call(self._cut())
        self._call(self._end_connections())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _end_connections(self) -> None:
        if not self._connections:
            return
        _, pending = await asyncio.wait(self._connections, timeout=5)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}
