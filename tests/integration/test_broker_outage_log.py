"""A broker outage in the log, against the real RabbitMQ through a proxy the test cuts: once when it
starts and once when the robust connection is back, instead of aio-pika's and aiormq's lines for
every reconnect attempt."""

import asyncio
import logging
import time

import pytest
import structlog

from shared.clients import connect_amqp
from tests.e2e.tcpproxy import TcpProxy


async def test_a_broker_outage_is_logged_once_and_its_end_once(service_urls, caplog: pytest.LogCaptureFixture) -> None:
    proxy = TcpProxy.to(service_urls.amqp)
    caplog.set_level(logging.INFO)
    try:
        with structlog.testing.capture_logs() as logs:
            connection = await connect_amqp(proxy.proxied(service_urls.amqp), timeout_s=5)
            try:
                proxy.cut()
                await asyncio.sleep(3.5)  # three reconnect attempts, a second apart
                proxy.restore()
                deadline = time.monotonic() + 10
                while not connection.connected.is_set():
                    assert time.monotonic() < deadline, "not reconnected"
                    await asyncio.sleep(0.05)
            finally:
                await connection.close()
    finally:
        proxy.close()
    outage = [entry for entry in logs if entry["event"].startswith("amqp_")]
    assert [entry["event"] for entry in outage] == ["amqp_failed", "amqp_recovered"]
    assert outage[1]["failures"] >= 3 and outage[1]["lines_held_back"] >= 3
    attempts = [
        r for r in caplog.records if "Reconnecting after" in r.getMessage() or "creating transport" in r.getMessage()
    ]
    assert attempts == []
