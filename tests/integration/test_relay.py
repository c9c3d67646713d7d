"""TokenRelay against the real Redis: subscribe-before-publish, fan-out, slow consumers, spares."""

import asyncio

import pytest

from services.sessions.relay import STREAM_LOST, TokenRelay
from shared.names import Names
from tests.e2e.tcpproxy import TcpProxy
from tests.waiting import until


def _relay(namespace: str, url: str, *, spares: int = 0) -> TokenRelay:
    return TokenRelay(url, Names(namespace), buffer_chunks=16, subscribe_timeout_s=2, spare_streams=spares)


@pytest.fixture
async def relay(namespace, service_urls):
    relay = _relay(namespace, service_urls.redis)
    yield relay
    await relay.stop()


async def test_message_published_right_after_open_is_received(relay, redis_client, namespace) -> None:
    stream = await relay.open_job()
    assert stream.channel == f"{namespace}:tokens:{stream.job_id}"
    # open_job() returned only after Redis confirmed: a publish now must reach us.
    assert await redis_client.publish(stream.channel, b"first") == 1
    assert await stream.next(timeout_s=2) == b"first"
    await stream.close()

    async def unsubscribed() -> bool:  # the unsubscribe goes out with the next batch
        return await redis_client.publish(stream.channel, b"late") == 0

    await until(unsubscribed, timeout_s=2, what="the closed stream unsubscribed")


async def test_many_streams_receive_only_their_own_chunks(relay, redis_client) -> None:
    streams = await asyncio.gather(*(relay.open_job() for _ in range(50)))
    assert relay.active_streams == 50 and len({s.job_id for s in streams}) == 50
    for index, stream in enumerate(streams):
        await redis_client.publish(stream.channel, str(index).encode())
    received = [await s.next(timeout_s=2) for s in streams]
    assert received == [str(i).encode() for i in range(50)]
    await asyncio.gather(*(s.close() for s in streams))
    assert relay.active_streams == 0


async def test_slow_reader_is_cut_off_not_buffered_forever(relay, redis_client) -> None:
    stream = await relay.open_job()
    for index in range(40):  # buffer holds 16
        await redis_client.publish(stream.channel, str(index).encode())
    items = []
    while True:
        item = await stream.next(timeout_s=2)
        items.append(item)
        if item == STREAM_LOST:
            break
    assert len(items) <= 16 and items[-1] == STREAM_LOST


async def test_next_times_out(relay) -> None:
    stream = await relay.open_job()
    with pytest.raises(TimeoutError):
        await stream.next(timeout_s=0.2)
    await stream.close()


async def test_spare_streams_are_subscribed_ahead_and_refilled(redis_client, namespace, service_urls) -> None:
    relay = _relay(namespace, service_urls.redis, spares=8)
    try:
        await relay.open_job()  # no spare yet: subscribes on demand, and starts the refill
        for _ in range(50):
            if len(relay._spares) == 8:
                break
            await asyncio.sleep(0.02)
        ahead = relay._spares[-1]
        assert await redis_client.publish(ahead.channel, b"x") == 1  # already subscribed, before anyone asks
        taken = await relay.open_job()
        assert taken is ahead and await taken.next(timeout_s=2) == b"x"
        assert relay.active_streams == 2
    finally:
        await relay.stop()


async def test_a_dropped_subscriber_connection_ends_every_stream_and_the_next_open_reconnects(
    redis_client, namespace, service_urls
) -> None:
    proxy = TcpProxy.to(service_urls.redis)
    relay = _relay(namespace, proxy.proxied(service_urls.redis))
    try:
        stream = await relay.open_job()
        await redis_client.publish(stream.channel, b"before")
        assert await stream.next(timeout_s=2) == b"before"
        proxy.cut()
        assert await stream.next(timeout_s=2) == STREAM_LOST
        assert relay.active_streams == 0
        proxy.restore()
        again = await relay.open_job()
        await redis_client.publish(again.channel, b"after")
        assert await again.next(timeout_s=2) == b"after"
    finally:
        await relay.stop()
        proxy.close()


async def test_a_merged_stream_relays_its_choices_in_arrival_order_each_with_its_index(relay, redis_client) -> None:
    streams = await asyncio.gather(*(relay.open_job() for _ in range(3)))
    merged = relay.merge(list(streams))
    for channel, data in ((2, b"c0"), (0, b"a0"), (2, b"c1"), (1, b"b0")):
        await redis_client.publish(streams[channel].channel, data)
    received = []
    for _ in range(4):
        data = await merged.next(timeout_s=2)
        received.append((merged.index, data))
    assert received == [(2, b"c0"), (0, b"a0"), (2, b"c1"), (1, b"b0")]
    assert not merged.ready
    with pytest.raises(TimeoutError):
        await merged.next(timeout_s=0.1)
    assert relay.active_streams == 3
    await merged.close()
    assert relay.active_streams == 0


async def test_one_choice_cut_off_ends_the_merged_stream(relay, redis_client) -> None:
    streams = await asyncio.gather(*(relay.open_job() for _ in range(2)))
    merged = relay.merge(list(streams))  # holds 2 x 16 chunks
    for index in range(40):
        await redis_client.publish(streams[1].channel, str(index).encode())
    items = []
    while (item := await merged.next(timeout_s=2)) != STREAM_LOST:
        items.append(item)
    assert merged.index == 1 and len(items) < 32
    await merged.close()


async def test_a_stream_lost_before_it_was_merged_ends_the_merged_stream(namespace, service_urls) -> None:
    proxy = TcpProxy.to(service_urls.redis)
    relay = _relay(namespace, proxy.proxied(service_urls.redis))
    try:
        streams = await asyncio.gather(*(relay.open_job() for _ in range(2)))
        proxy.cut()  # the subscriber connection drops: every stream is lost
        while await streams[0].next(timeout_s=2) != STREAM_LOST:
            pass
        merged = relay.merge(list(streams))
        assert await merged.next(timeout_s=2) == STREAM_LOST
    finally:
        await relay.stop()
        proxy.close()
