"""Anthropic's error envelope and statuses, for the Messages API's routes (`/v1/messages...`).

Axon's exceptions name OpenAI's error type and status (`shared/errors.py`); on Anthropic's routes
the same exception is answered in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with Anthropic's type for its status: 400 `invalid_request_error`, 401
`authentication_error`, 403 `permission_error`, 404 `not_found_error`, 413 `request_too_large`,
429 `rate_limit_error`, 500 `api_error`, 504 `timeout_error`, and 529 `overloaded_error` for a
refusal because the platform is full (a model's queue, the gateway's in-flight requests, the
broker not taking jobs in time). The one mapping from exceptions to responses stays
`shared/http_errors.py`, which picks this shape by path (`anthropic_path`).

Rate-limit headers travel under Anthropic's names on these routes (`anthropic_headers`):
`anthropic-ratelimit-requests-limit`, `-remaining`, `-reset` (an RFC 3339 time) and the same for
`tokens`, beside `retry-after`.
"""

import datetime as dt
import re
from collections.abc import Mapping
from typing import Any, Final

from shared.errors import AxonError

# Every route of Anthropic's API that Axon serves starts with this.
ANTHROPIC_PREFIX: Final = "/v1/messages"

# Anthropic's status for an overloaded platform (not a standard HTTP status).
OVERLOADED_STATUS: Final = 529
# The `Unavailable` codes that mean the platform is full, not that a part of it is away.
_OVERLOADED_CODES = frozenset({"overloaded", "queue_full"})

_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    OVERLOADED_STATUS: "overloaded_error",
}


def anthropic_path(path: str) -> bool:
    """Whether `path` is one of Anthropic's routes (errors there take Anthropic's shape)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_status(exc: AxonError) -> int:
    """The status of `exc` on an Anthropic route: its own, except 529 for a full platform."""
    if exc.status_code == 503 and exc.code in _OVERLOADED_CODES:
        return OVERLOADED_STATUS
    return exc.status_code


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for `status` (a 503, a part of the platform away, is
    `overloaded_error` too: the client's answer to both is to come back)."""
    if status in _TYPES:
        return _TYPES[status]
    if status == 503:
        return "overloaded_error"
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(message: str, *, status: int) -> dict[str, Any]:
    """Anthropic's error envelope for an error of `status`."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def anthropic_error(exc: AxonError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """`exc` as Anthropic answers it: its status, body and headers (rate-limit headers renamed).

    The body is what a Message Batch's errored result holds too (`result.error`).
    """
    status = anthropic_status(exc)
    return status, anthropic_error_body(exc.message, status=status), anthropic_headers(exc.headers)


# `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (shared/ratelimit.py).
_OPENAI_RATE_HEADER = re.compile(r"^x-ratelimit-(limit|remaining|reset)-(requests|tokens)$", re.IGNORECASE)
# `format_duration`'s resets: `20ms`, `1.5s`, `6m0s`.
_DURATION = re.compile(r"^(?:(\d+)m)?(?:([\d.]+)s)?$|^(\d+)ms$")


def anthropic_headers(headers: Mapping[str, str], *, now: dt.datetime | None = None) -> dict[str, str]:
    """`headers` with the rate-limit ones under Anthropic's names (`anthropic-ratelimit-tokens-limit`,
    ..., a reset as the RFC 3339 time it happens); the others as they are."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        match = _OPENAI_RATE_HEADER.match(name)
        if match is None:
            out[name] = value
            continue
        field, kind = match.group(1).lower(), match.group(2).lower()
        if field == "reset":
            value = _reset_time(value, now or dt.datetime.now(dt.UTC))
        out[f"anthropic-ratelimit-{kind}-{field}"] = value
    return out


def _reset_time(duration: str, now: dt.datetime) -> str:
    """The RFC 3339 time (UTC, whole seconds rounded up) `duration` after `now`."""
    match = _DURATION.match(duration)
    if match is None:
        return duration
    minutes, seconds, ms = match.groups()
    total_s = int(ms) / 1000 if ms is not None else int(minutes or 0) * 60 + float(seconds or 0)
    at = now + dt.timedelta(seconds=total_s)
    if at.microsecond:
        at = at.replace(microsecond=0) + dt.timedelta(seconds=1)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")
