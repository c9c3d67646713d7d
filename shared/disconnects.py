"""A client that goes away before its answer: the exception that says so, and the two ways a
request's work learns of it and stops."""

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from starlette.types import Receive, Scope

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody is left to answer."""


_DISCONNECT_POLL_S = 0.5


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away (a non-streaming client that gave up),
    so the cancellation travels upstream and the generation stops.

    Raises:
        ClientGone: the client disconnected first.
    """
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone


class DisconnectWatch:
    """Cancels the handler's task if the client disconnects before `stop()`, so its work (a
    generation upstream) is abandoned at once; `HotRoutes` answers that cancellation as 499.

    Start it once the request body has been read: it takes over `receive`.
    """

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._scope = scope
        self._task: asyncio.Task[Any] | None = asyncio.current_task()
        self._active = True
        self._watcher: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(self._watch(receive))

    @staticmethod
    def caused(scope: Scope) -> bool:
        """True if a watch cancelled this request's task (and takes that cancellation back)."""
        if not scope.get("axon.disconnected"):
            return False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return True

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._active and self._task is not None:
            self._scope["axon.disconnected"] = True
            self._task.cancel()

    def stop(self) -> None:
        """The answer is complete (or about to be): a disconnect from now on changes nothing.

        Both task references are dropped: the cancelled watcher's traceback points back at this
        watch, a cycle that only the garbage collector would free, with the request's scope in it
        (half the CPU of a hot request went to collecting them, `benchmarks/micro/hot_routes.py`).
        """
        self._active = False
        watcher, self._watcher = self._watcher, None
        self._task = None
        if watcher is not None:
            watcher.cancel()
