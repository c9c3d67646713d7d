"""OpenAI's Batch object and the Batch API's errors."""

import datetime as dt
import uuid
from typing import Any

from services.sessions.batches.store import BatchRecord
from shared.errors import NotFound

BATCH_PREFIX = "batch_"
# OpenAI's only completion window, in seconds.
WINDOWS_S = {"24h": 86_400}


def new_batch_id() -> str:
    return BATCH_PREFIX + uuid.uuid4().hex


def _epoch(moment: dt.datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def batch_object(record: BatchRecord) -> dict[str, Any]:
    """OpenAI's Batch object."""
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": record.errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": _epoch(record.created_at),
        "in_progress_at": _epoch(record.in_progress_at),
        "expires_at": _epoch(record.expires_at),
        "finalizing_at": _epoch(record.finalizing_at),
        "completed_at": _epoch(record.completed_at),
        "failed_at": _epoch(record.failed_at),
        "expired_at": _epoch(record.expired_at),
        "cancelling_at": _epoch(record.cancelling_at),
        "cancelled_at": _epoch(record.cancelled_at),
        "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
        "metadata": record.metadata,
    }


def batch_list(records: list[BatchRecord], has_more: bool) -> dict[str, Any]:
    """A page of batches, as OpenAI lists them."""
    data = [batch_object(r) for r in records]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def batch_not_found(batch_id: str) -> NotFound:
    return NotFound(f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")


def output_line(request_id: str, custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line of the output file (`status_code` 200) or of the error file (a 4xx or 5xx answer)."""
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {"id": request_id, "custom_id": custom_id, "response": response, "error": None}
