"""The micro-benchmarks of `benchmarks/micro/` still run: each one's `main` with a few calls gives a
positive figure for every contender of every comparison (real Redis, a real upstream process); and
so does `benchmarks/hop_floor.py` with a few streams for a moment."""

import asyncio
import os
import secrets

import pytest

from benchmarks import hop_floor
from benchmarks.micro import hot_routes, http1, redis_pipe
from shared.clients import create_redis

FEW = ["--calls", "40", "--rounds", "1", "--warmup", "10", "--concurrency", "10"]


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    """This run's Redis: the shared `service_urls` fixture's where there is one, else the local one."""
    try:
        return str(request.getfixturevalue("service_urls").redis)
    except pytest.FixtureLookupError:
        return os.environ.get("AXON_TEST_redis_url", "redis://127.0.0.1:6379/0")


def _assert_figures(figures: dict[str, dict[str, float]], comparisons: int, contenders: set[str]) -> None:
    assert len(figures) == comparisons
    for per_contender in figures.values():
        assert set(per_contender) == contenders
        assert all(value > 0 for value in per_contender.values()), per_contender


def test_redis_pipe_benchmark_measures_every_client_and_leaves_no_keys(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = f"axon_micro_test_{secrets.token_hex(4)}:"
    figures = redis_pipe.main([*FEW, "--url", redis_url, "--namespace", namespace])
    _assert_figures(figures, 2, {"redis_pipe", "redis-py", "coredis"})
    assert "redis_pipe" in capsys.readouterr().out

    async def leftover() -> list[bytes]:
        client = create_redis(redis_url, timeout_s=5)
        try:
            return [key async for key in client.scan_iter(match=f"{namespace}*")]
        finally:
            await client.aclose()

    assert asyncio.run(leftover()) == []


def test_http1_benchmark_measures_every_client() -> None:
    figures = http1.main([*FEW, "--events", "3"])
    _assert_figures(figures, 2, {"http1", "aiohttp", "httpx"})


def test_hot_routes_benchmark_measures_both_routes() -> None:
    figures = hot_routes.main([*FEW, "--loop", "asyncio"])
    _assert_figures(figures, 2, {"HotRoute", "FastAPI"})


def test_hop_floor_carries_every_token_in_both_styles(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    figures = hop_floor.main(["--streams", "4", "--seconds", "0.5", "--redis-url", redis_url])
    assert figures is not None
    assert set(figures) == {"callbacks", "tasks"}
    for per_process in figures.values():
        assert set(per_process) == {"worker", "sessions", "gateway"}
        # /proc counts the servers' CPU in clock ticks (10 ms), more than a moment's relay may take
        assert per_process["worker"] > 0 and min(per_process.values()) >= 0, per_process
    # 4 streams, a token every 20 ms for 0.5 s: 25 tokens each, all of them received in both runs
    assert "tokens received callbacks 100, tasks 100" in capsys.readouterr().out
