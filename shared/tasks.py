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

    def cancel(self) -> None:
        """Cancel every task it holds (each runs its own cleanup)."""
        for task in self._tasks:
            task.cancel()

    async def wait(self) -> None:
        """Until every task it started has finished, those they start meanwhile too."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
