"""The worker's cancel listener against the real Redis: a cancel published while it is subscribed
reaches the runner, and after its connection drops it subscribes again."""

import asyncio
import time

from services.worker.job_runner import listen_for_cancellations
from services.worker.redis_gate import RedisGate
from shared.names import Names
from shared.redis_pipe import RedisPipe
from tests.e2e.tcpproxy import TcpProxy


class _Runner:
    """Stands in for the JobRunner: records the job ids it is asked to cancel."""

    def __init__(self) -> None:
        self.cancelled: asyncio.Queue[str] = asyncio.Queue()

    async def cancel(self, job_id: str) -> None:
        await self.cancelled.put(job_id)


async def _cancel_until_received(redis_client, channel: str, job_id: str, runner: _Runner) -> str:
    """Publish the cancel until the runner gets it (the listener subscribes in the background)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if await redis_client.publish(channel, job_id):
            try:
                return await asyncio.wait_for(runner.cancelled.get(), 0.5)
            except TimeoutError:
                continue  # received by a connection Redis had not yet seen drop
        await asyncio.sleep(0.05)
    raise AssertionError(f"{job_id} never reached the runner")


async def test_cancels_reach_the_runner_before_and_after_a_dropped_connection(
    redis_client, namespace, service_urls
) -> None:
    names = Names(f"{namespace}-cancel")
    proxy = TcpProxy.to(service_urls.redis)
    runner = _Runner()
    url = proxy.proxied(service_urls.redis)
    pipe = RedisPipe(url, timeout_s=2)
    gate = RedisGate(pipe, on_down=lambda _reason: asyncio.sleep(0), on_up=lambda: asyncio.sleep(0))
    listener = asyncio.create_task(listen_for_cancellations(url, names, runner, gate, timeout_s=2))
    try:
        assert await _cancel_until_received(redis_client, names.cancel_channel, "job-1", runner) == "job-1"
        proxy.cut()
        await asyncio.sleep(0.2)
        proxy.restore()
        assert await _cancel_until_received(redis_client, names.cancel_channel, "job-2", runner) == "job-2"
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await gate.close()
        await pipe.aclose()
        proxy.close()
