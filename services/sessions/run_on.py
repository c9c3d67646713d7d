"""Answers that go on without their client, and what a stopping session manager does with them.

Two kinds of answer run on after the request that started them ended:
- a leased one (a stored response; later a batch line): its record in Redis names this process as
  its owner for a lease it renews (`leases.py`), so any other session manager can take
  it over from its job's chunk log when the lease expires;
- an unleased one (a streamed session turn whose client left or whose stream was lost): nobody
  else knows of it, so it can only end here.

One policy when the process stops: what another process can finish is handed over at once (the
leases are given up, and another replica's next sweep takes the answers over); the rest go on
here until the stop's deadline (`call_off`, the at-deadline hook), when they end as cancelled.
"""

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from services.sessions.leases import ResponseLeases
from shared.tasks import BackgroundTasks


class RunOn:
    """Owns every answer that runs on without its client (see the module's docstring)."""

    def __init__(self, leases: ResponseLeases) -> None:
        self.leases = leases
        self._unleased = BackgroundTasks()
        # The stop's deadline passed: nothing runs on any more.
        self.called_off = False

    def run_on(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro`, an unleased answer, in a task of its own until it ends or the stop's
        deadline calls it off."""
        self._unleased.spawn(coro)

    def hold(self, answer_id: str, coro: Coroutine[Any, Any, Any]) -> "asyncio.Task[Any]":
        """Run `coro`, the relay of leased `answer_id`, in a task of its own; its lease is renewed
        until it ends (one that loses its lease, or whose answer is finished elsewhere, is
        cancelled)."""
        return self.leases.hold(answer_id, coro)

    @contextlib.contextmanager
    def attached(self, answer_id: str) -> Iterator[None]:
        """Renew leased `answer_id`'s lease while the block (its client's request) relays it."""
        with self.leases.attached(answer_id):
            yield

    def abandoned(self, answer_id: str) -> bool:
        """Whether `answer_id`'s relay was cancelled because it was finished elsewhere."""
        return self.leases.abandoned(answer_id)

    async def sweep(self, take_over: Callable[[str], Coroutine[Any, Any, object]]) -> None:
        """Renew this process's leases and take over the answers whose leases expired, for ever."""
        await self.leases.run(take_over)

    async def call_off(self) -> None:
        """The stop's deadline passed: every unleased answer still running ends now, as cancelled."""
        self.called_off = True
        self._unleased.cancel()

    async def stop(self) -> None:
        """The process stops: hand the leased answers over at once, then wait for the unleased
        ones, each of which ends by its own deadline or the stop's (`call_off`)."""
        await self.leases.stop()
        await self._unleased.wait()
