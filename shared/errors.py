"""Axon's exceptions and the one OpenAI-style error envelope.

Each exception names its HTTP status and OpenAI error type, so mapping an
exception to a response happens in one place (`shared.http_errors`).
"""

from collections.abc import Collection, Mapping, Sequence
from typing import Any


class AxonError(Exception):
    """Base error; subclasses fix the status code and OpenAI error type."""

    status_code: int = 500
    error_type: str = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, error_type=self.error_type, param=self.param, code=self.code)


class InvalidRequest(AxonError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(AxonError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class Forbidden(AxonError):
    status_code = 403
    error_type = "permission_error"


class NotFound(AxonError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class Conflict(AxonError):
    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class RequestTimeout(AxonError):
    """The client did not send its request (its body) in time. The connection is closed after the
    answer: the rest of the body may still be on its way and cannot start another request."""

    status_code = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.headers.setdefault("connection", "close")


class PayloadTooLarge(AxonError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class FileTooLarge(PayloadTooLarge):
    """An uploaded file is larger than AXON_FILE_MAX_BYTES; nothing of it is kept."""

    default_code = "file_too_large"

    @classmethod
    def over(cls, max_bytes: int) -> "FileTooLarge":
        return cls(f"File is too large: the maximum is {max_bytes} bytes.", param="file")


class EmptyFile(InvalidRequest):
    """An uploaded file has no bytes; nothing is kept."""

    default_code = "empty_file"


class FileGone(NotFound):
    """No such file for the caller's tenant (unknown, expired, deleted, another tenant's), or it
    was deleted while being read."""

    default_code = "file_not_found"

    @classmethod
    def of(cls, file_id: str) -> "FileGone":
        return cls(f"No such File object: {file_id}", param="file_id")


class RateLimited(AxonError):
    """A per-key limit is exhausted; the headers say exactly when to come back."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class Unavailable(AxonError):
    """Refused early because nothing can serve the request now; retry after `retry_after_s`."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class DeadlineExceeded(AxonError):
    status_code = 504
    error_type = "timeout_error"
    default_code = "deadline_exceeded"


class UpstreamError(AxonError):
    """A dependency failed in a way the caller cannot fix."""

    status_code = 502
    error_type = "server_error"
    default_code = "upstream_error"


def error_body(
    message: str,
    *,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """Return OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# What pydantic puts in an error's `loc` for the member of a union it tried (`str`,
# `list[TextPart]`, `literal['none','auto']`, a model's class name): not a field of the body.
_UNION_LABELS = frozenset({"str", "int", "float", "bool", "none", "bytes", "dict", "list"})


def _is_union_label(part: object) -> bool:
    return isinstance(part, str) and (part in _UNION_LABELS or "[" in part or part[:1].isupper())


def _body_path(loc: Sequence[Any]) -> tuple[Any, ...]:
    """An error's location in the body (FastAPI's start with `body`)."""
    return tuple(loc[1:] if loc[:1] == ("body",) else loc)


def invalid_request(errors: Sequence[Mapping[str, Any]], *, whole: Collection[str] = ()) -> InvalidRequest:
    """The 400 for a body that failed validation (pydantic's or FastAPI's error list).

    Unknown top-level fields are refused as OpenAI refuses them ("Unrecognized request argument(s)
    supplied: …", sorted, `param` and `code` null). Otherwise the first error, with the field it is
    about as `param` (a path such as `messages.0.content`; for a field in `whole`, the field alone).
    """
    locs = [_body_path(e.get("loc", ())) for e in errors]
    unknown = sorted(
        str(loc[0]) for e, loc in zip(errors, locs, strict=True) if e.get("type") == "extra_forbidden" and len(loc) == 1
    )
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        return InvalidRequest(f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}")
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return InvalidRequest("The request body is not valid JSON.", code="invalid_request")
    params = [_param(loc, whole) for loc in locs]
    param = params[0] if params else None
    if param is not None and (bound := _out_of_bounds(first, param)) is not None:
        return bound
    # A value no member of a union accepts fails once per member: say what each wanted.
    reasons = dict.fromkeys(
        str(e.get("msg", "Invalid value")) for e, p in zip(errors, params, strict=True) if p == param
    )
    message = " or ".join(reasons) or "Invalid request body"
    return InvalidRequest(f"{param}: {message}" if param else message, param=param, code="invalid_request")


# pydantic's error types for a number outside its bounds: OpenAI's word for the side, and the
# comparison its message shows.
_BOUNDS = {
    "greater_than_equal": ("below_min", "ge", ">="),
    "greater_than": ("below_min", "gt", ">"),
    "less_than_equal": ("above_max", "le", "<="),
    "less_than": ("above_max", "lt", "<"),
}


def _out_of_bounds(error: Mapping[str, Any], param: str) -> InvalidRequest | None:
    """A number outside its field's bounds as OpenAI refuses it: `integer_below_min_value` (or
    `integer_above_max_value`, `decimal_…` for a field whose bound is a float) with its message,
    "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got -1 instead."."""
    side, key, sign = _BOUNDS.get(str(error.get("type")), (None, "", ""))
    bound = (error.get("ctx") or {}).get(key)
    value = error.get("input")
    if side is None or not isinstance(bound, int | float) or isinstance(value, bool):
        return None
    kind = "decimal" if isinstance(bound, float) else "integer"
    word = "minimum" if side == "below_min" else "maximum"
    below_or_above = side.split("_")[0]
    return InvalidRequest(
        f"Invalid '{param}': {kind} {below_or_above} {word} value. "
        f"Expected a value {sign} {bound:g}, but got {value} instead.",
        param=param,
        code=f"{kind}_{side}_value",
    )


def _param(loc: tuple[Any, ...], whole: Collection[str]) -> str | None:
    parts = [str(part) for part in loc if not _is_union_label(part)]
    if parts and parts[0] in whole:
        parts = parts[:1]
    return ".".join(parts) or None
