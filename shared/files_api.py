"""OpenAI's Files API (`/v1/files`) as Axon takes it: the upload form's fields and bounds, and
the objects it answers with.

Plain pydantic (no fastapi): the session manager checks uploads with these constants
(`services/sessions/files/protocol.py`) and the gateway's OpenAPI document is generated from them
(the response models document what `FileRecord.to_openai` returns).
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# Axon keeps files for its Batch API only; OpenAI's other purposes (fine-tune, assistants, vision,
# user_data, evals) name uses Axon has no endpoint for, so they are refused rather than stored.
# `batch_output` files are the Batch API's own (its output and error files), never uploaded.
UPLOAD_PURPOSES = ("batch",)
# The form's fields besides `file`, which must come before it.
FORM_FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")
# OpenAI's bounds of `expires_after[seconds]`: an hour to 30 days.
EXPIRES_AFTER_MIN_S = 3600
EXPIRES_AFTER_MAX_S = 30 * 86_400
# Files one page of `GET /v1/files` lists at most (and by default), as OpenAI's.
LIST_MAX = 10_000


def upload_form_schema() -> dict[str, Any]:
    """The JSON Schema of `POST /v1/files`'s multipart form (fields in the order they must come)."""
    return {
        "type": "object",
        "required": ["purpose", "file"],
        "properties": {
            "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES), "description": "What the file is for."},
            "expires_after[anchor]": {
                "type": "string",
                "enum": ["created_at"],
                "description": "With `expires_after[seconds]`: when the file expires, counted from its creation.",
            },
            "expires_after[seconds]": {
                "type": "integer",
                "minimum": EXPIRES_AFTER_MIN_S,
                "maximum": EXPIRES_AFTER_MAX_S,
                "description": "Seconds after `created_at` the file expires (default for `batch`: 30 days).",
            },
            "file": {
                "type": "string",
                "format": "binary",
                "description": "The file (for `batch`, the Batch API's JSONL input); must be the form's last part.",
            },
        },
    }


class FileObject(BaseModel):
    """OpenAI's File object."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: Literal["processed"]
    status_details: None


class FileList(BaseModel):
    """A page of File objects."""

    model_config = ConfigDict(extra="forbid")

    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["file"]
    deleted: Literal[True]
