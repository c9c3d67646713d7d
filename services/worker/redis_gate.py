"""The worker's view of Redis: up, or down until a probe gets an answer.

Without Redis a worker can do nothing useful: a job's chunks cannot be published, its progress
not recorded, its heartbeat not written. So whatever finds Redis unreachable (a job's publish, the
heartbeat, the cancel listener) reports it here and waits. The first report logs the outage once
(`redis_failed`), calls `on_down` (the worker stops taking jobs and `/ready` says why) and starts
one probe, a `PING` with capped exponential backoff (`shared/outages.py`); its first answer calls
`on_up` (consuming again, ready) and releases every waiter, and `redis_recovered` says how long
the outage lasted, how many tries failed and how many jobs waited. A job that waited is tried again from its progress
on the same delivery: nothing is requeued, so no outage counts as one of its deliveries.
"""

import asyncio
import contextvars
from collections.abc import Awaitable, Callable

from shared.logging import get_logger
from shared.outages import Outage, describe
from shared.redis_pipe import RedisPipe

log = get_logger(__name__)


class RedisGate:
    """Open while Redis answers; closed from the first report of an outage until a probe answers."""

    def __init__(
        self,
        pipe: RedisPipe,
        *,
        on_down: Callable[[str], Awaitable[None]],
        on_up: Callable[[], Awaitable[None]],
    ) -> None:
        self._pipe = pipe
        self._on_down = on_down
        self._on_up = on_up
        self._open = asyncio.Event()
        self._open.set()
        self._outage = Outage("redis")
        self._probe: asyncio.Task[None] | None = None
        # Jobs that waited for the outage's end (reported it or came while it lasted).
        self._jobs_waited = 0

    @property
    def up(self) -> bool:
        return self._open.is_set()

    def report(self, exc: BaseException) -> None:
        """Redis was found unreachable (`shared.outages.redis_unreachable(exc)`): close the gate
        until a probe answers (once per outage; later reports are only counted)."""
        if self._probe is not None:
            self._outage.failed(exc)
            return
        # Logged and probed outside the reporter's context: the outage is the worker's, not a job's.
        context = contextvars.Context()
        context.run(self._outage.failed, exc)
        self._open.clear()
        self._probe = asyncio.get_running_loop().create_task(self._wait_for_redis(describe(exc)), context=context)

    async def wait_until_up(self, *, job: bool = False) -> None:
        """Return at once while Redis is up, else when it is back (`job`: counted as a job that waited)."""
        if self._open.is_set():
            return
        if job:
            self._jobs_waited += 1
        await self._open.wait()

    async def outage(self, exc: BaseException) -> None:
        """`report(exc)`, then wait for the end of the outage, as a job."""
        self.report(exc)
        await self.wait_until_up(job=True)

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)

    async def _wait_for_redis(self, reason: str) -> None:
        await self._on_down(reason)
        while True:
            try:
                await self._pipe.execute("PING")
                break
            except Exception as exc:  # noqa: BLE001 - any failure: Redis is still away
                await asyncio.sleep(self._outage.failed(exc))
        self._outage.recovered(jobs_waited=self._jobs_waited)
        self._jobs_waited = 0
        self._probe = None
        self._open.set()
        await self._on_up()
