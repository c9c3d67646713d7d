"""shared.errors: each exception fixes its status and OpenAI error type; one envelope shape."""

import pytest

from shared.errors import (
    AxonError,
    Conflict,
    DeadlineExceeded,
    EmptyFile,
    FileGone,
    FileTooLarge,
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    Unauthorized,
    Unavailable,
    UpstreamError,
    error_body,
)

# (class, status, OpenAI type, code when none is given)
CASES = [
    (AxonError, 500, "server_error", None),
    (InvalidRequest, 400, "invalid_request_error", None),
    (Unauthorized, 401, "authentication_error", "invalid_api_key"),
    (Forbidden, 403, "permission_error", None),
    (NotFound, 404, "invalid_request_error", "not_found"),
    (ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (Conflict, 409, "invalid_request_error", "conflict"),
    (RequestTimeout, 408, "invalid_request_error", "request_timeout"),
    (PayloadTooLarge, 413, "invalid_request_error", "request_too_large"),
    (FileTooLarge, 413, "invalid_request_error", "file_too_large"),
    (EmptyFile, 400, "invalid_request_error", "empty_file"),
    (FileGone, 404, "invalid_request_error", "file_not_found"),
    (RateLimited, 429, "rate_limit_error", "rate_limit_exceeded"),
    (Unavailable, 503, "service_unavailable", None),
    (DeadlineExceeded, 504, "timeout_error", "deadline_exceeded"),
    (UpstreamError, 502, "server_error", "upstream_error"),
]


def test_cases_cover_every_subclass() -> None:
    def subclasses(cls: type) -> set[type]:
        found = set(cls.__subclasses__())
        for sub in list(found):
            found |= subclasses(sub)
        return found

    covered = {case[0] for case in CASES}
    assert subclasses(AxonError) <= covered


@pytest.mark.parametrize(("cls", "status", "error_type", "default_code"), CASES)
def test_status_type_and_body_shape(
    cls: type[AxonError], status: int, error_type: str, default_code: str | None
) -> None:
    exc = cls("something went wrong")
    assert isinstance(exc, AxonError)
    assert exc.status_code == status
    assert exc.error_type == error_type
    body = exc.body()
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] == "something went wrong"
    assert body["error"]["type"] == error_type
    assert body["error"]["code"] == default_code
    assert str(exc) == "something went wrong"


@pytest.mark.parametrize("cls", [c[0] for c in CASES if c[0] is not Unavailable])
def test_param_and_explicit_code_reach_the_body(cls: type[AxonError]) -> None:
    exc = cls("bad", param="messages.0.content", code="custom_code")
    assert exc.body()["error"] == {
        "message": "bad",
        "type": cls.error_type,
        "param": "messages.0.content",
        "code": "custom_code",
    }


def test_plain_errors_have_no_extra_headers() -> None:
    assert InvalidRequest("x").headers == {}
    assert InvalidRequest("x", headers={"X-Y": "1"}).headers == {"X-Y": "1"}


def test_headers_are_not_shared_between_instances() -> None:
    first = InvalidRequest("a")
    first.headers["X-Leak"] = "1"
    assert InvalidRequest("b").headers == {}


def test_unavailable_sets_retry_after() -> None:
    exc = Unavailable("no worker for model", retry_after_s=7, code="no_worker")
    assert exc.headers == {"Retry-After": "7"}
    assert exc.retry_after_s == 7
    assert exc.body()["error"]["code"] == "no_worker"
    assert exc.body()["error"]["type"] == "service_unavailable"


def test_unavailable_default_retry_after_is_one_second() -> None:
    assert Unavailable("busy").headers == {"Retry-After": "1"}


def test_model_not_found_is_a_not_found() -> None:
    with pytest.raises(NotFound):
        raise ModelNotFound("no such model", param="model")


def test_error_body_defaults() -> None:
    assert error_body("m", error_type="t") == {"error": {"message": "m", "type": "t", "param": None, "code": None}}
