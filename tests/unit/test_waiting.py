"""tests/waiting.py: a wait returns what the check found, or fails naming what it awaited."""

import itertools

import pytest

from tests.waiting import until, wait_for


def test_wait_for_returns_the_first_true_value() -> None:
    counter = itertools.count()
    assert wait_for(lambda: next(counter) >= 3 and "done", timeout_s=5, what="three", interval_s=0) == "done"


def test_wait_for_fails_naming_what_it_awaited() -> None:
    with pytest.raises(AssertionError, match=r"not within 0.05 s: the impossible"):
        wait_for(lambda: False, timeout_s=0.05, what="the impossible", interval_s=0.01)


async def test_until_awaits_the_check() -> None:
    counter = itertools.count()

    async def check() -> int:
        return next(counter)

    assert await until(check, timeout_s=5, what="a true count", interval_s=0) == 1
    assert await until(lambda: next(counter), timeout_s=5, what="a plain check", interval_s=0) == 2
    with pytest.raises(AssertionError, match="never"):
        await until(lambda: _false(), timeout_s=0.05, what="never", interval_s=0.01)


async def _false() -> bool:
    return False
