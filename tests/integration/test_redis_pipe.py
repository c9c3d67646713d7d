"""The auto-pipelined Redis connection against the real Redis: order, errors, scripts, failures."""

import asyncio
import uuid

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.cli.launcher import free_port
from shared.redis_pipe import NotSent, PipeScript, RedisPipe, pack
from tests.e2e.tcpproxy import TcpProxy


@pytest.fixture
async def pipe(service_urls):
    pipe = RedisPipe(service_urls.redis, timeout_s=2)
    yield pipe
    await pipe.aclose()


def test_pack_speaks_resp() -> None:
    assert pack(("SET", b"k", 12, 1.5)) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$3\r\n1.5\r\n"


async def test_concurrent_commands_share_writes_and_each_gets_its_own_reply(pipe, redis_client) -> None:
    key = f"test:pipe:{uuid.uuid4().hex}"
    replies = await asyncio.gather(*(pipe.execute("INCR", key) for _ in range(500)))
    assert sorted(replies) == list(range(1, 501))
    assert replies == list(range(1, 501))  # in the order they were issued
    assert await pipe.execute("GET", key) == b"500"
    await redis_client.delete(key)


async def test_an_error_reply_fails_only_its_own_command(pipe, redis_client) -> None:
    key = f"test:pipe:{uuid.uuid4().hex}"
    await pipe.execute("SET", key, "text")
    results = await asyncio.gather(pipe.execute("INCR", key), pipe.execute("GET", key), return_exceptions=True)
    assert isinstance(results[0], ResponseError) and results[1] == b"text"
    await redis_client.delete(key)


async def test_a_script_is_loaded_on_first_use_and_again_after_a_flush(pipe, redis_client) -> None:
    script = PipeScript(f"-- {uuid.uuid4().hex}\nreturn {{KEYS[1], ARGV[1]}}")
    assert await pipe.evalsha(script, ["k"], [7]) == [b"k", b"7"]
    assert await pipe.evalsha(script, ["k"], [8]) == [b"k", b"8"]
    await redis_client.script_flush()
    assert await pipe.evalsha(script, ["k"], [9]) == [b"k", b"9"]


async def test_a_lost_connection_fails_what_is_in_flight_and_the_next_command_reconnects(service_urls) -> None:
    proxy = TcpProxy.to(service_urls.redis)
    pipe = RedisPipe(proxy.proxied(service_urls.redis), timeout_s=2)
    try:
        assert await pipe.execute("PING") == b"PONG"
        proxy.cut()
        with pytest.raises(RedisConnectionError):
            await pipe.execute("PING")  # written on the connection the cut dropped: it may have run
        with pytest.raises(NotSent):  # a ConnectionError that says the command never left
            await pipe.execute("PING")  # refused: the proxy is not listening
        proxy.restore()
        assert await pipe.execute("PING") == b"PONG"
    finally:
        await pipe.aclose()
        proxy.close()


async def test_a_server_that_never_answers_times_out() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def mute(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    port = free_port()
    server = await asyncio.start_server(mute, "127.0.0.1", port)
    pipe = RedisPipe(f"redis://127.0.0.1:{port}/0", timeout_s=0.3)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(RedisTimeoutError) as timed_out:
            await pipe.execute("PING")
        assert not isinstance(timed_out.value, NotSent)  # sent: it may have run
        assert asyncio.get_running_loop().time() - started < 2
    finally:
        await pipe.aclose()
        server.close()
        for writer in accepted:
            writer.close()


async def test_a_database_number_and_a_wrong_password_are_honoured(redis_client, service_urls) -> None:
    key = f"test:pipe:{uuid.uuid4().hex}"
    other = RedisPipe(service_urls.redis.rsplit("/", 1)[0] + "/3", timeout_s=2)
    try:
        await other.execute("SET", key, "in db 3")
        assert await redis_client.get(key) is None  # the fixture's client is on db 0
        assert await other.execute("GET", key) == b"in db 3"
        await other.execute("DEL", key)
    finally:
        await other.aclose()
    wrong = RedisPipe(service_urls.redis.replace("redis://", "redis://:not-the-password@"), timeout_s=2)
    try:
        with pytest.raises(RedisConnectionError, match="refused the connection's setup"):
            await wrong.execute("PING")
    finally:
        await wrong.aclose()


async def test_submitted_scripts_share_a_write_and_reload_after_a_flush(pipe, redis_client) -> None:
    script = PipeScript(f"-- {uuid.uuid4().hex}\nreturn ARGV[1]")
    replies = await asyncio.gather(*(pipe.submit_script(script, [], [i]) for i in range(20)))
    assert replies == [str(i).encode() for i in range(20)]
    await redis_client.script_flush()
    replies = await asyncio.gather(*(pipe.submit_script(script, [], [i]) for i in range(3)))
    assert replies == [b"0", b"1", b"2"]


async def test_a_script_s_own_error_reaches_its_caller_and_a_loaded_script_runs_once(pipe, redis_client) -> None:
    key = f"test:pipe:{uuid.uuid4().hex}"
    failing = PipeScript(f"-- {uuid.uuid4().hex}\nreturn redis.error_reply('NOT_THIS ' .. ARGV[1])")
    with pytest.raises(ResponseError, match="NOT_THIS 1"):
        await pipe.evalsha(failing, [], [1])
    counting = PipeScript(f"-- {uuid.uuid4().hex}\nreturn redis.call('INCR', KEYS[1])")
    assert await asyncio.gather(*(pipe.evalsha(counting, [key], []) for _ in range(3))) == [1, 2, 3]
    assert await pipe.execute("GET", key) == b"3"  # each call ran once, the first ones after the load
    await redis_client.delete(key)
