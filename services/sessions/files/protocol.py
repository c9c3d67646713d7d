"""OpenAI's Files API on the wire: an upload's fields checked (`shared/files_api.py` says which
there are), the list and deletion objects and the errors."""

import re
from typing import Any

from services.sessions.files.store import FileRecord
from shared.errors import InvalidRequest
from shared.files_api import EXPIRES_AFTER_MAX_S, EXPIRES_AFTER_MIN_S, UPLOAD_PURPOSES

FIELD_MAX_BYTES = 1024
# ASCII digits only: str.isdigit() takes "³", which int() refuses.
_SECONDS = re.compile(r"[0-9]{1,10}")
FILENAME_MAX_CHARS = 1024


def missing(param: str) -> InvalidRequest:
    return InvalidRequest(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def check_purpose(fields: dict[str, str]) -> str:
    """The upload's purpose, from the fields before its file.

    Raises:
        InvalidRequest: none came before the file, or one Axon does not store.
    """
    purpose = fields.get("purpose")
    if purpose is None:
        raise InvalidRequest(
            "Missing required parameter: 'purpose' (it must come before 'file' in the form).",
            param="purpose",
            code="missing_required_parameter",
        )
    if purpose not in UPLOAD_PURPOSES:
        supported = ", ".join(f"'{p}'" for p in UPLOAD_PURPOSES)
        raise InvalidRequest(
            f"Invalid value for 'purpose': {purpose!r}. Supported values are: {supported}.",
            param="purpose",
            code="invalid_value",
        )
    return purpose


def expires_after_s(fields: dict[str, str]) -> int | None:
    """`expires_after[seconds]` (with `expires_after[anchor]` `created_at`), None if not given.

    Raises:
        InvalidRequest: half given, another anchor, or seconds out of OpenAI's bounds.
    """
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequest(
            "Invalid value for 'expires_after.anchor': it must be 'created_at'.",
            param="expires_after.anchor",
            code="invalid_value",
        )
    low, high = EXPIRES_AFTER_MIN_S, EXPIRES_AFTER_MAX_S
    if seconds is None or not _SECONDS.fullmatch(seconds) or not low <= int(seconds) <= high:
        raise InvalidRequest(
            f"Invalid value for 'expires_after.seconds': it must be an integer from {low} to {high}.",
            param="expires_after.seconds",
            code="invalid_value",
        )
    return int(seconds)


def check_filename(filename: str | None) -> str:
    """The uploaded file's name (its part's Content-Disposition `filename`).

    Raises:
        InvalidRequest: `file` is a plain field, not a file, or its name is too long.
    """
    if filename is None:
        raise InvalidRequest("'file' must be a file (a part with a filename).", param="file", code="invalid_value")
    if len(filename) > FILENAME_MAX_CHARS:
        raise InvalidRequest(
            f"The file's name is longer than {FILENAME_MAX_CHARS} characters.", param="file", code="invalid_value"
        )
    return filename


def file_list(records: list[FileRecord], *, has_more: bool) -> dict[str, Any]:
    """OpenAI's list of File objects."""
    return {
        "object": "list",
        "data": [record.to_openai() for record in records],
        "first_id": records[0].id if records else None,
        "last_id": records[-1].id if records else None,
        "has_more": has_more,
    }


def file_deleted(file_id: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "deleted": True}
