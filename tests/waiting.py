"""Waiting for a condition instead of sleeping for a guess: poll until it holds, fail with what was
awaited once the deadline passes. (A bare sleep passes when the thing is late and slows every run
when it is early.)"""

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], *, timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Call `check()` until it returns something true; return that.

    Raises:
        AssertionError: naming `what`, when `timeout_s` passed first.
    """
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(interval_s)
    return found


async def until(check: Callable[[], Awaitable[T] | T], *, timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """`wait_for` in a coroutine, without blocking the event loop; `check` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if inspect.isawaitable(found):
            found = await found
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(interval_s)
