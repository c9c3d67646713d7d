"""How a loop that talks to Redis, RabbitMQ or PostgreSQL lives through its dependency's outage:
it waits longer and longer between tries, up to a cap (`Backoff`), and logs the outage once, not
each failed try (`Outage`): a warning with the first error, then, when a try succeeds again, one
line with how long it lasted and how many tries failed.

A loop that retried every second and logged each failure wrote a line a second per loop (a worker
whose jobs were requeued at once wrote a thousand, each with a traceback); its log now says what
happened in two lines, and the cap keeps its recovery within `cap_s` of the dependency's return.
"""

import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.logging import get_logger

log = get_logger(__name__)

# The first wait after a failure, and the longest: tries soon after a blip, and at least every
# half second during an outage, so that work resumes within half a second of its end.
FIRST_DELAY_S = 0.05
MAX_DELAY_S = 0.5


class Backoff:
    """Waits that double from `first_s` up to `cap_s`, until `reset`."""

    def __init__(self, first_s: float = FIRST_DELAY_S, cap_s: float = MAX_DELAY_S) -> None:
        self._first_s = first_s
        self._cap_s = cap_s
        self._next_s = first_s

    def next_delay(self) -> float:
        """The wait before the next try; the one after is twice as long, up to the cap."""
        delay = self._next_s
        self._next_s = min(self._next_s * 2, self._cap_s)
        return delay

    def reset(self) -> None:
        self._next_s = self._first_s


class Outage:
    """One loop's view of a dependency: up, or down since a failure, logged once each way.

    `failed(exc)` logs `<event>_failed` (a warning with the error, no traceback) the first time,
    only counts later failures, and returns how long to wait before trying again; `recovered()`
    logs `<event>_recovered` with the outage's duration and its failed tries, if there was one.
    """

    def __init__(
        self, event: str, *, first_s: float = FIRST_DELAY_S, cap_s: float = MAX_DELAY_S, **context: object
    ) -> None:
        self._event = event
        self._context = context
        self._backoff = Backoff(first_s, cap_s)
        self._since: float | None = None
        self.failures = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException, **details: object) -> float:
        """Record a failed try (the first logged with `details`); returns the wait before the next one."""
        self.failures += 1
        if self._since is None:
            self._since = time.monotonic()
            log.warning(f"{self._event}_failed", error=describe(exc), **details, **self._context)
        return self._backoff.next_delay()

    def recovered(self, **figures: object) -> None:
        """A try succeeded: log the end of the outage, if there was one (with `figures`)."""
        if self._since is None:
            return
        log.info(
            f"{self._event}_recovered",
            down_s=round(time.monotonic() - self._since, 1),
            failures=self.failures,
            **figures,
            **self._context,
        )
        self._since = None
        self.failures = 0
        self._backoff.reset()


def describe(exc: BaseException) -> str:
    """`exc`'s class and message (redis-py's exceptions print only a category as their `repr`)."""
    return f"{type(exc).__name__}: {exc}"


# Replies of a Redis that is up but cannot serve yet: loading its data after a restart.
_NOT_SERVING = ("LOADING",)


def redis_unreachable(exc: BaseException) -> bool:
    """Whether `exc` says Redis cannot be reached or cannot serve (an outage, nobody's fault),
    rather than that a command was wrong."""
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(_NOT_SERVING)
