"""Anthropic's Message Batches without services: a batch's requests checked as Anthropic checks them
at create (its shape; each request's params when it runs), made its lines, and the
`message_batch` object's statuses, counts and times as a batch's row maps onto them."""

import dataclasses
import datetime as dt
import json
import math

import pytest
from pydantic import ValidationError

from services.sessions.batches.messages import (
    message_batch_object,
    message_lines,
    new_message_batch_id,
    result_line,
)
from services.sessions.batches.store import MESSAGES_ENDPOINT, BatchRecord
from shared.errors import InvalidRequest
from shared.message_batch_requests import MessageBatchCreate
from shared.tokens import estimate_tokens


def _body(*requests: dict[str, object]) -> MessageBatchCreate:
    return MessageBatchCreate.model_validate({"requests": list(requests)})


def _request(custom_id: str, **params: object) -> dict[str, object]:
    return {"custom_id": custom_id, "params": {"model": "m", "max_tokens": 8, **params}}


def test_each_request_is_a_line_its_params_its_body() -> None:
    lines = message_lines(_body(_request("a"), _request("b-2_X", messages=[])), max_requests=10, default_max_tokens=100)
    assert [(x.line, x.custom_id, x.model) for x in lines] == [(1, "a", "m"), (2, "b-2_X", "m")]
    assert lines[0].body == '{"model":"m","max_tokens":8}'
    assert lines[0].tokens == estimate_tokens(chars=len(lines[0].body)) + 8
    # A max_tokens the Messages API will refuse counts as the default until the line runs.
    [line] = message_lines(_body(_request("c", max_tokens=-1)), max_requests=10, default_max_tokens=100)
    assert line.tokens == estimate_tokens(chars=len(line.body)) + 100


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"requests": []}, "requests"),
        ({"requests": [{"custom_id": "a b", "params": {"model": "m"}}]}, "custom_id"),
        ({"requests": [{"custom_id": "x" * 65, "params": {"model": "m"}}]}, "custom_id"),
        ({"requests": [{"custom_id": "", "params": {"model": "m"}}]}, "custom_id"),
        ({"requests": [{"custom_id": "a", "params": "m"}]}, "params"),
        ({"requests": [{"custom_id": "a", "params": {}, "extra": 1}]}, "extra"),
        ({"requests": [{"custom_id": "a", "params": {}}], "metadata": {}}, "metadata"),
    ],
)
def test_a_batch_of_the_wrong_shape_is_refused_at_create(body: dict[str, object], param: str) -> None:
    with pytest.raises(ValidationError) as refused:
        MessageBatchCreate.model_validate(body)
    assert param in str(refused.value.errors()[0]["loc"])


@pytest.mark.parametrize(
    ("requests", "param", "max_requests"),
    [
        ([_request("a"), _request("b"), _request("a")], "requests.2.custom_id", 10),
        ([_request("a"), {"custom_id": "b", "params": {"max_tokens": 8}}], "requests.1.params.model", 10),
        ([{"custom_id": "a", "params": {"model": ""}}], "requests.0.params.model", 10),
        ([{"custom_id": "a", "params": {"model": "m\x00"}}], "requests.0.params.model", 10),
        # More than AXON_BATCH_MAX_REQUESTS.
        ([_request("a"), _request("b"), _request("c")], "requests", 2),
    ],
)
def test_a_request_the_batch_cannot_take_is_a_400_naming_it(
    requests: list[dict[str, object]], param: str, max_requests: int
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        message_lines(_body(*requests), max_requests=max_requests, default_max_tokens=100)
    assert refused.value.param == param and refused.value.message.startswith(param)


def test_params_orjson_cannot_write_are_stored_escaped_for_the_run_to_judge() -> None:
    """A big integer, a lone surrogate (JSON's escapes allow them) or nesting past 254 levels are
    valid JSON: the line is kept, its body written by the standard library (ASCII), and its model
    as PostgreSQL's text can hold it; its run answers it as `POST /v1/messages` would."""
    deep: object = "x"
    for _ in range(300):
        deep = [deep]
    requests = [
        _request("big", top_k=2**70),
        _request("deep", messages=deep),
        {"custom_id": "lone", "params": {"model": "m\udb5b", "max_tokens": 8, "system": "a\udb5bb"}},
    ]
    big, nested, lone = message_lines(_body(*requests), max_requests=10, default_max_tokens=100)
    assert json.loads(big.body)["top_k"] == 2**70
    assert json.loads(nested.body)["messages"] == deep
    assert lone.model == "m\ufffd" and json.loads(lone.body)["system"] == "a\udb5bb"
    for line in (big, nested, lone):
        line.body.encode("ascii")
        line.model.encode()


def test_params_no_json_can_hold_are_a_400() -> None:
    with pytest.raises(InvalidRequest) as refused:
        message_lines(_body(_request("a", top_k=2**70, temperature=math.nan)), max_requests=10, default_max_tokens=100)
    assert refused.value.param == "requests.0.params"


_CREATED = dt.datetime(2026, 11, 28, 12, 0, 0, 123456, tzinfo=dt.UTC)


def _record(**fields: object) -> BatchRecord:
    record = BatchRecord(
        id=new_message_batch_id(),
        tenant="t",
        key_id=None,
        endpoint=MESSAGES_ENDPOINT,
        input_file_id=None,
        completion_window="24h",
        status="in_progress",
        metadata=None,
        errors=None,
        output_file_id=None,
        error_file_id=None,
        total=10,
        completed=0,
        failed=0,
        created_at=_CREATED,
        expires_at=_CREATED + dt.timedelta(days=1),
        in_progress_at=_CREATED,
    )
    return dataclasses.replace(record, **fields)  # type: ignore[arg-type]


def test_a_running_batch_is_in_progress_its_lines_processing_and_no_results_url() -> None:
    record = _record(completed=3, failed=1)
    batch = message_batch_object(record, results_url="http://gw/r")
    assert batch["type"] == "message_batch" and batch["processing_status"] == "in_progress"
    assert batch["request_counts"] == {"processing": 6, "succeeded": 3, "errored": 1, "canceled": 0, "expired": 0}
    assert batch["created_at"] == "2026-11-28T12:00:00.123456Z" and batch["expires_at"] == "2026-11-29T12:00:00.123456Z"
    assert batch["ended_at"] is None and batch["results_url"] is None and batch["cancel_initiated_at"] is None
    # Its results being written: still in progress.
    assert message_batch_object(_record(status="finalizing"), results_url="u")["processing_status"] == "in_progress"


def test_a_canceled_batchs_unrun_lines_are_canceled_an_expired_ones_expired() -> None:
    asked = _CREATED + dt.timedelta(minutes=1)
    canceling = message_batch_object(_record(status="cancelling", cancelling_at=asked), results_url="u")
    assert (
        canceling["processing_status"] == "canceling"
        and canceling["cancel_initiated_at"] == "2026-11-28T12:01:00.123456Z"
    )
    ended = _CREATED + dt.timedelta(minutes=2)
    canceled = _record(status="cancelled", cancelling_at=asked, cancelled_at=ended, completed=4, failed=6, unrun=5)
    batch = message_batch_object(canceled, results_url="http://gw/v1/messages/batches/x/results")
    assert batch["processing_status"] == "ended" and batch["ended_at"] == "2026-11-28T12:02:00.123456Z"
    assert batch["request_counts"] == {"processing": 0, "succeeded": 4, "errored": 1, "canceled": 5, "expired": 0}
    assert batch["results_url"] == "http://gw/v1/messages/batches/x/results"
    expired = message_batch_object(_record(status="expired", expired_at=ended, failed=10, unrun=10), results_url="u")
    assert expired["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 10}


def test_a_result_line_is_the_message_or_anthropics_error_with_the_request_id() -> None:
    message = {"id": "msg_1", "type": "message"}
    assert result_line("a", request_id="r", status=200, body=message) == {
        "custom_id": "a",
        "result": {"type": "succeeded", "message": message},
    }
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: required"}}
    assert result_line("b", request_id="r", status=400, body=error) == {
        "custom_id": "b",
        "result": {"type": "errored", "error": {**error, "request_id": "r"}},
    }
