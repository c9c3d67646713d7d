"""shared/anthropic_errors.py: Axon's exceptions in Anthropic's envelope, statuses and header names."""

import datetime as dt

import pytest

from shared.anthropic_errors import anthropic_error, anthropic_headers, anthropic_path
from shared.errors import (
    AxonError,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
    Unavailable,
    UpstreamError,
)

NOW = dt.datetime(2026, 11, 28, 23, 0, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("exc", "status", "error_type"),
    [
        (InvalidRequest("x"), 400, "invalid_request_error"),
        (Unauthorized("x"), 401, "authentication_error"),
        (Forbidden("x"), 403, "permission_error"),
        (ModelNotFound("x"), 404, "not_found_error"),
        (PayloadTooLarge("x"), 413, "request_too_large"),
        (RateLimited("x"), 429, "rate_limit_error"),
        (AxonError("x"), 500, "api_error"),
        (UpstreamError("x"), 502, "api_error"),
        (DeadlineExceeded("x"), 504, "timeout_error"),
        # The platform full: Anthropic's 529; a part of it away: 503, to come back to as well.
        (Unavailable("x", code="queue_full"), 529, "overloaded_error"),
        (Unavailable("x", code="overloaded"), 529, "overloaded_error"),
        (Unavailable("x", code="no_worker"), 503, "overloaded_error"),
    ],
)
def test_each_status_has_anthropics_type(exc: AxonError, status: int, error_type: str) -> None:
    got_status, body, _ = anthropic_error(exc)
    assert got_status == status
    assert body == {"type": "error", "error": {"type": error_type, "message": "x"}}


def test_rate_limit_headers_take_anthropics_names_and_a_reset_time() -> None:
    headers = {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1.5s",
        "x-ratelimit-reset-tokens": "6m0s",
        "Retry-After": "2",
    }
    assert anthropic_headers(headers, now=NOW) == {
        "anthropic-ratelimit-requests-limit": "60",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2026-11-28T23:00:02Z",
        "anthropic-ratelimit-tokens-reset": "2026-11-28T23:06:00Z",
        "Retry-After": "2",
    }
    assert anthropic_headers({"x-ratelimit-reset-tokens": "20ms"}, now=NOW) == {
        "anthropic-ratelimit-tokens-reset": "2026-11-28T23:00:01Z"
    }


def test_only_the_messages_routes_are_anthropics() -> None:
    assert anthropic_path("/v1/messages") and anthropic_path("/v1/messages/batches/x")
    assert not anthropic_path("/v1/messagesx") and not anthropic_path("/v1/chat/completions")
