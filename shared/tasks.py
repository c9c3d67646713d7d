"""Fire-and-forget work that must still run to the end (and not be garbage-collected)."""

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    """Holds references to the tasks it starts until they finish."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
