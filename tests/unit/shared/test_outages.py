"""Capped exponential backoff, an outage logged once each way, and which errors are outages."""

import structlog
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.outages import Backoff, Outage, describe, redis_unreachable


def test_backoff_doubles_up_to_its_cap_and_starts_again_after_a_reset() -> None:
    backoff = Backoff(first_s=0.05, cap_s=0.5)
    assert [backoff.next_delay() for _ in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next_delay() == 0.05


def test_an_outage_is_logged_once_with_its_first_error_then_its_end_with_the_failures() -> None:
    outage = Outage("heartbeat", cap_s=0.2, worker="w1")
    with structlog.testing.capture_logs() as logs:
        outage.recovered()  # nothing failed: nothing to say
        delays = [outage.failed(RedisConnectionError(f"refused {i}"), entries=i) for i in range(1, 5)]
        assert outage.down
        outage.recovered(jobs_waited=2)
        outage.recovered()
    assert delays == [0.05, 0.1, 0.2, 0.2]
    assert not outage.down
    assert [entry["event"] for entry in logs] == ["heartbeat_failed", "heartbeat_recovered"]
    failed, recovered = logs
    assert (failed["log_level"], failed["error"], failed["entries"], failed["worker"]) == (
        "warning",
        "ConnectionError: refused 1",
        1,
        "w1",
    )
    assert (recovered["failures"], recovered["jobs_waited"], recovered["worker"]) == (4, 2, "w1")
    assert recovered["down_s"] >= 0
    # The next outage starts from the first delay again.
    with structlog.testing.capture_logs() as logs:
        assert outage.failed(RedisTimeoutError("slow")) == 0.05
    assert [entry["event"] for entry in logs] == ["heartbeat_failed"]


def test_only_an_unreachable_or_loading_redis_is_an_outage() -> None:
    for exc in (
        RedisConnectionError("refused"),
        RedisTimeoutError("no reply"),
        BusyLoadingError("loading"),
        ResponseError("LOADING Redis is loading the dataset in memory"),
    ):
        assert redis_unreachable(exc), exc
    # Another dependency's connection error (the broker's) or a deadline is not Redis's outage.
    for exc in (ResponseError("WRONGTYPE Operation against a key"), ConnectionResetError(), TimeoutError()):
        assert not redis_unreachable(exc), exc


def test_describe_names_the_class_and_the_message() -> None:
    assert describe(RedisConnectionError("Error connecting to 127.0.0.1:6379")) == (
        "ConnectionError: Error connecting to 127.0.0.1:6379"
    )
