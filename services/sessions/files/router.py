"""OpenAI's Files API (`/v1/files`) on the caller's tenant's files (`files/store.py`). Another
tenant's file gets 404.

An upload is read as it arrives (`files/multipart.py`): its `purpose` (and `expires_after`) come
first, as the official clients send them, then its `file`, whose bytes stream into the store;
content streams out the same way, a piece at a time.
"""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from services.sessions.deps import CallerDep, ServicesDep
from services.sessions.files.multipart import MultipartReader, boundary_of, malformed
from services.sessions.files.protocol import (
    FIELD_MAX_BYTES,
    check_filename,
    check_purpose,
    expires_after_s,
    file_deleted,
    file_list,
    missing,
)
from services.sessions.files.store import FileRecord, FileStore
from shared.errors import AxonError, FileGone, InvalidRequest, RequestTimeout
from shared.files_api import FORM_FIELDS, LIST_MAX
from shared.hot_routes import stream_body
from shared.logging import bind_contextvars

router = APIRouter(prefix="/v1/files")

# The gateway gives up on a client that sends nothing for AXON_REQUEST_BODY_TIMEOUT_S (30 s by
# default); this only bounds a bad internal caller.
_BODY_STALL_S = 120.0


@router.post("")
async def create_file(request: Request, caller: CallerDep, services: ServicesDep) -> dict[str, Any]:
    """Upload a file (multipart/form-data: `purpose`, then `file`)."""
    reader = MultipartReader(
        stream_body(request.receive, stall_timeout_s=_BODY_STALL_S), boundary_of(request.headers.get("content-type"))
    )
    try:
        record = await _upload(reader, services.files, tenant=caller.tenant, max_bytes=services.file_max_bytes)
    except AxonError as exc:
        if exc.status_code < 500 and not isinstance(exc, RequestTimeout):
            # The client is answered once it has sent everything: an answer sent mid-upload is
            # lost to most clients, which are still writing. The gateway bounds what that reads.
            await reader.skip_rest()
        raise
    bind_contextvars(file_id=record.id)
    return record.to_openai()


async def _upload(reader: MultipartReader, store: FileStore, *, tenant: str, max_bytes: int) -> FileRecord:
    """The form's fields up to its file, the file stored as it arrives, and nothing after it.

    Raises:
        InvalidRequest: a field unknown, missing or wrong, or not valid multipart.
        FileTooLarge, EmptyFile: as the store says.
    """
    fields: dict[str, str] = {}
    while (part := await reader.next_part()) is not None:
        if part.name == "file":
            purpose, expiry_s, filename = check_purpose(fields), expires_after_s(fields), check_filename(part.filename)
            record = await store.create(
                tenant=tenant,
                purpose=purpose,
                filename=filename,
                chunks=reader.data(),
                max_bytes=max_bytes,
                expires_after_s=expiry_s,
            )
            try:
                if await reader.next_part() is not None:
                    raise malformed("'file' must be the form's last part.")
            except BaseException:
                await store.delete(tenant, record.id)
                raise
            return record
        if part.name not in FORM_FIELDS:
            raise InvalidRequest(f"Unrecognized request argument supplied: {part.name}", param=part.name)
        if part.name in fields:
            raise InvalidRequest(f"'{part.name}' is given twice.", param=part.name, code="invalid_value")
        fields[part.name] = await reader.text(max_bytes=FIELD_MAX_BYTES)
    check_purpose(fields)
    raise missing("file")


@router.get("")
async def list_files(
    caller: CallerDep,
    services: ServicesDep,
    purpose: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=LIST_MAX)] = LIST_MAX,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    after: Annotated[str | None, Query(max_length=64, description="id of the last file of the previous page")] = None,
) -> dict[str, Any]:
    """List your files, newest first unless `order=asc` (`purpose`, `limit`, `after`)."""
    records, has_more = await services.files.list(caller.tenant, purpose=purpose, after=after, limit=limit, order=order)
    return file_list(records, has_more=has_more)


async def _file(store: FileStore, tenant: str, file_id: str) -> FileRecord:
    """The tenant's file.

    Raises:
        FileGone: none (unknown, expired, deleted, another tenant's).
    """
    bind_contextvars(file_id=file_id)
    record = await store.get(tenant, file_id)
    if record is None:
        raise FileGone.of(file_id)
    return record


@router.get("/{file_id}")
async def get_file(file_id: str, caller: CallerDep, services: ServicesDep) -> dict[str, Any]:
    """Get one of your files."""
    return (await _file(services.files, caller.tenant, file_id)).to_openai()


@router.get("/{file_id}/content")
async def get_file_content(file_id: str, caller: CallerDep, services: ServicesDep) -> StreamingResponse:
    """Download one of your files' content."""
    record = await _file(services.files, caller.tenant, file_id)
    # Content-Length: a download cut short (the file deleted meanwhile) is seen as such.
    return StreamingResponse(
        services.files.read(caller.tenant, file_id),
        media_type="application/octet-stream",
        headers={"content-length": str(record.bytes)},
    )


@router.delete("/{file_id}")
async def delete_file(file_id: str, caller: CallerDep, services: ServicesDep) -> dict[str, Any]:
    """Delete one of your files."""
    bind_contextvars(file_id=file_id)
    if not await services.files.delete(caller.tenant, file_id):
        raise FileGone.of(file_id)
    return file_deleted(file_id)
