"""services.sessions.relay.Inbox: a stream's chunks in order, its reader woken by each, and its
wait bounded by a deadline that one timer keeps, moved on as the reader's deadline moves."""

import asyncio
import time

import pytest

from services.sessions.relay import Inbox


async def test_items_come_out_in_order_and_at_once_when_buffered() -> None:
    inbox: Inbox[bytes] = Inbox(maxsize=3)
    for item in (b"a", b"b", b"c"):
        inbox.put_nowait(item)
    assert inbox.full() and not inbox.empty()
    with pytest.raises(asyncio.QueueFull):
        inbox.put_nowait(b"d")
    assert [await inbox.get(0.0), inbox.get_nowait(), await inbox.get(1.0)] == [b"a", b"b", b"c"]
    with pytest.raises(asyncio.QueueEmpty):
        inbox.get_nowait()


async def test_a_waiting_reader_is_woken_by_the_next_item() -> None:
    inbox: Inbox[bytes] = Inbox()
    reading = asyncio.create_task(inbox.get(5.0))
    await asyncio.sleep(0)  # the reader waits
    inbox.put_nowait(b"a")
    assert await asyncio.wait_for(reading, 1) == b"a"


async def test_a_wait_ends_at_its_deadline_and_what_comes_later_is_kept() -> None:
    inbox: Inbox[bytes] = Inbox()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await inbox.get(0.1)
    assert time.monotonic() - started >= 0.1
    inbox.put_nowait(b"late")
    assert await inbox.get(0.1) == b"late"


async def test_the_deadline_moves_on_with_each_wait() -> None:
    """The timer armed by the first wait (deadline 0.4 s) finds the second wait (from 0.2 s, deadline
    0.6 s) still within its own: the second gets the item put at 0.5 s."""
    inbox: Inbox[bytes] = Inbox()
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, inbox.put_nowait, b"first")
    loop.call_later(0.5, inbox.put_nowait, b"second")
    assert await inbox.get(0.4) == b"first"
    assert await inbox.get(0.4) == b"second"
    with pytest.raises(TimeoutError):
        await inbox.get(0.05)


async def test_an_earlier_deadline_than_the_armed_one_is_kept() -> None:
    inbox: Inbox[bytes] = Inbox()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, inbox.put_nowait, b"first")
    assert await inbox.get(10.0) == b"first"  # a timer armed for 10 s
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await inbox.get(0.1)
    assert time.monotonic() - started < 5


async def test_a_wait_after_close_still_ends_at_its_deadline() -> None:
    inbox: Inbox[bytes] = Inbox()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, inbox.put_nowait, b"a")
    assert await inbox.get(60.0) == b"a"
    inbox.close()
    reading = asyncio.create_task(inbox.get(0.1))  # the close cancelled the 60 s timer: this wait arms its own
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reading, 5)
