"""TokenRelay against the real Redis: subscribe-before-publish, fan-out, slow consumers."""

import asyncio
import uuid

import pytest

from shared.clients import create_redis
from services.sessions.relay import STREAM_LOST, TokenRelay
from tests.conftest import REDIS_URL


@pytest.fixture
async def relay(namespace):
    subscriber = create_redis(REDIS_URL, timeout_s=5, for_pubsub=True)
    relay = TokenRelay(
        subscriber, home_channel=f"{namespace}:relay:{uuid.uuid4().hex}", buffer_chunks=16, subscribe_timeout_s=5
    )
    await relay.start()
    yield relay
    await relay.stop()
    await subscriber.aclose()


async def test_message_published_right_after_open_is_received(relay, redis_client, namespace) -> None:
    channel = f"{namespace}:tokens:{uuid.uuid4()}"
    stream = await relay.open(channel)
    # open() returned only after Redis confirmed: a publish now must reach us.
    assert await redis_client.publish(channel, b"first") == 1
    assert await stream.next(timeout_s=2) == b"first"
    await stream.close()
    assert await redis_client.publish(channel, b"late") == 0


async def test_many_streams_receive_only_their_own_chunks(relay, redis_client, namespace) -> None:
    channels = [f"{namespace}:tokens:{uuid.uuid4()}" for _ in range(50)]
    streams = await asyncio.gather(*(relay.open(c) for c in channels))
    assert relay.active_streams == 50
    for index, channel in enumerate(channels):
        await redis_client.publish(channel, str(index).encode())
    received = [await s.next(timeout_s=2) for s in streams]
    assert received == [str(i).encode() for i in range(50)]
    await asyncio.gather(*(s.close() for s in streams))
    assert relay.active_streams == 0


async def test_slow_reader_is_cut_off_not_buffered_forever(relay, redis_client, namespace) -> None:
    channel = f"{namespace}:tokens:{uuid.uuid4()}"
    stream = await relay.open(channel)
    for index in range(40):  # buffer holds 16
        await redis_client.publish(channel, str(index).encode())
    items = []
    while True:
        item = await stream.next(timeout_s=2)
        items.append(item)
        if item == STREAM_LOST:
            break
    assert len(items) <= 16 and items[-1] == STREAM_LOST


async def test_next_times_out(relay, namespace) -> None:
    stream = await relay.open(f"{namespace}:tokens:{uuid.uuid4()}")
    with pytest.raises(TimeoutError):
        await stream.next(timeout_s=0.2)
    await stream.close()
