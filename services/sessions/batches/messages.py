"""Anthropic's Message Batches (`/v1/messages/batches`) on the Batch API's machinery: the batch's
requests checked and made its lines (`message_lines`), the `message_batch` object, its pages, and
the lines of its results file.

A message batch is a batch of endpoint `/v1/messages` (`store.MESSAGES_ENDPOINT`): created
`in_progress` with its lines, run, leased, taken over and answered exactly once as any batch is
(`service.py`), each line through the Messages API's own translation. Its statuses map onto
Anthropic's `processing_status`: `in_progress` (and `finalizing`, its results being written),
`canceling` (`cancelling`), `ended` (`completed`, `cancelled`, `expired`). Its counts onto
Anthropic's `request_counts`: `succeeded` (`completed`), `errored` (`failed` less `unrun`), and
the lines never run, `unrun`, as `canceled` (a cancel was asked) or `expired`; `processing` the
rest.
"""

import datetime as dt
import hashlib
import json
import re
import uuid
from typing import Any

import orjson

from services.sessions.batches.store import BatchRecord
from services.sessions.batches.validation import BatchLine
from shared.errors import InvalidRequest, NotFound
from shared.message_batch_requests import MessageBatchCreate
from shared.tokens import estimate_tokens

MESSAGE_BATCH_PREFIX = "msgbatch_"
# What `new_message_batch_id` makes: anything else names no message batch.
MESSAGE_BATCH_ID = re.compile(r"^msgbatch_[0-9a-f]{32}$")
# Anthropic's window: a batch not ended 24 hours after it was created expires.
WINDOW = "24h"
# What one line may count at most (an integer column).
_MAX_LINE_TOKENS = 2**31 - 1


def new_message_batch_id() -> str:
    return MESSAGE_BATCH_PREFIX + uuid.uuid4().hex


def message_batch_not_found(batch_id: str) -> NotFound:
    return NotFound(f"No message batch found with id '{batch_id}'.", param="message_batch_id")


def message_lines(body: MessageBatchCreate, *, max_requests: int, default_max_tokens: int) -> list[BatchLine]:
    """The batch's requests as its lines (numbered from 1), each its `params` as the line's body.

    Raises:
        InvalidRequest: more than `max_requests` requests, a `custom_id` used twice, or a request's
            `params` without a `model`, or that cannot be written as JSON: naming the request.
    """
    if len(body.requests) > max_requests:
        raise InvalidRequest(f"requests: a batch may hold at most {max_requests} requests.", param="requests")
    seen: dict[bytes, int] = {}
    lines: list[BatchLine] = []
    for index, request in enumerate(body.requests):
        digest = hashlib.blake2b(request.custom_id.encode(), digest_size=16).digest()
        first = seen.setdefault(digest, index)
        if first != index:
            raise InvalidRequest(
                f"requests.{index}.custom_id: '{request.custom_id}' is also the custom_id of requests.{first};"
                " each must be unique within the batch.",
                param=f"requests.{index}.custom_id",
            )
        model = request.params.get("model")
        if not isinstance(model, str) or not model or "\x00" in model:
            raise InvalidRequest(
                f"requests.{index}.params.model: a model must be named (a string without U+0000).",
                param=f"requests.{index}.params.model",
            )
        text = _stored_json(request.params)
        if text is None:
            raise InvalidRequest(
                f"requests.{index}.params: cannot be stored as JSON (nested too deep, or a number that is not one).",
                param=f"requests.{index}.params",
            )
        asked = request.params.get("max_tokens")
        max_tokens = asked if type(asked) is int and asked >= 1 else default_max_tokens
        tokens = min(estimate_tokens(chars=len(text)) + max_tokens, _MAX_LINE_TOKENS)
        lines.append(BatchLine(index + 1, request.custom_id, _storable_text(model), text, tokens))
    return lines


def _stored_json(params: dict[str, Any]) -> str | None:
    """`params` written as JSON to be stored: by orjson, or, what it cannot write (an integer past
    64 bits, a lone surrogate, nesting past `validation.MAX_BODY_DEPTH`), escaped to ASCII by the standard
    library (the line's run judges it as `POST /v1/messages` would); None if neither can."""
    try:
        return orjson.dumps(params).decode()
    except orjson.JSONEncodeError:
        try:
            return json.dumps(params, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        except (ValueError, RecursionError):
            return None


def _storable_text(text: str) -> str:
    """`text` as PostgreSQL's text can hold it (UTF-8): a lone surrogate (JSON's escapes allow
    them) becomes U+FFFD."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text


def _rfc3339(moment: dt.datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def processing_status(record: BatchRecord) -> str:
    if record.terminal:
        return "ended"
    return "canceling" if record.status == "cancelling" else "in_progress"


def message_batch_object(record: BatchRecord, *, results_url: str) -> dict[str, Any]:
    """Anthropic's `message_batch` object; `results_url`: where its results are, once it ended."""
    ended = record.terminal
    ended_at = record.completed_at or record.cancelled_at or record.expired_at or record.failed_at
    # A cancel asked: the lines never run were canceled (else they expired).
    unrun_as = "canceled" if record.cancelling_at is not None else "expired"
    counts = {
        "processing": record.total - record.completed - record.failed,
        "succeeded": record.completed,
        "errored": record.failed - record.unrun,
        "canceled": record.unrun if unrun_as == "canceled" else 0,
        "expired": record.unrun if unrun_as == "expired" else 0,
    }
    return {
        "id": record.id,
        "type": "message_batch",
        "processing_status": processing_status(record),
        "request_counts": counts,
        "created_at": _rfc3339(record.created_at),
        "ended_at": _rfc3339(ended_at) if ended else None,
        "expires_at": _rfc3339(record.expires_at),
        "cancel_initiated_at": _rfc3339(record.cancelling_at),
        "archived_at": None,
        "results_url": results_url if ended else None,
    }


def message_batch_list(objects: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """A page of message batches, as Anthropic lists them."""
    return {
        "data": objects,
        "has_more": has_more,
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
    }


def message_batch_deleted(batch_id: str) -> dict[str, Any]:
    return {"id": batch_id, "type": "message_batch_deleted"}


def result_line(custom_id: str, *, request_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line of the results file: `body` is the Message (`status` 200) or Anthropic's error envelope."""
    if status == 200:
        return {"custom_id": custom_id, "result": {"type": "succeeded", "message": body}}
    return {"custom_id": custom_id, "result": {"type": "errored", "error": {**body, "request_id": request_id}}}
