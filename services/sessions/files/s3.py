"""Files' bytes in an S3 bucket (AXON_FILE_STORE=s3), one object a file under
AXON_FILE_S3_PREFIX; their records stay in PostgreSQL (`store.py`).

An upload is an S3 multipart upload of pieces of `PIECE_BYTES` (S3's parts must be at least 5 MiB,
but the last), each sent before the next is read, and completed once the last is in: until then
there is no object, and an upload that fails is aborted. A download streams the object in pieces.
Credentials come from the environment as the AWS SDKs find them (on EKS, IRSA's web identity:
docs/deploy-eks.md). A process that dies mid-upload leaves an incomplete multipart upload behind,
which the bucket's lifecycle rule `AbortIncompleteMultipartUpload` removes (the chart's values
and docs/deploy-eks.md show it).
"""

import asyncio
import builtins
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import ClientError
from types_aiobotocore_s3 import S3Client
from types_aiobotocore_s3.type_defs import CompletedPartTypeDef

from services.sessions.settings import SessionsSettings
from shared.errors import FileGone
from shared.logging import get_logger

log = get_logger(__name__)

PIECE_BYTES = 8 * 1024 * 1024
# Pieces a download reads from the object's body at a time.
READ_BYTES = 1024 * 1024
# S3's limit on the keys of one DeleteObjects call.
_DELETE_BATCH = 1000
# How long one S3 call may wait for an answer (a part of 8 MiB included).
_READ_TIMEOUT_S = 60


class S3Content:
    """`FileContent` in a bucket: the file `file-…` is the object `<prefix>file-…`."""

    piece_bytes = PIECE_BYTES

    def __init__(self, client: S3Client, *, bucket: str, prefix: str) -> None:
        self._client = client
        self._bucket = bucket
        self._prefix = prefix

    def key(self, file_id: str) -> str:
        return self._prefix + file_id

    async def write(self, file_id: str, pieces: AsyncIterator[bytes]) -> None:
        key = self.key(file_id)
        upload = await self._client.create_multipart_upload(Bucket=self._bucket, Key=key)
        upload_id = upload["UploadId"]
        parts: list[CompletedPartTypeDef] = []
        try:
            async for piece in pieces:
                number = len(parts) + 1
                sent = await self._client.upload_part(
                    Bucket=self._bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=piece
                )
                parts.append({"ETag": sent["ETag"], "PartNumber": number})
            if parts:
                await self._client.complete_multipart_upload(
                    Bucket=self._bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
                return
        except BaseException:
            # Shielded: an upload cancelled (its client gone) is aborted all the same.
            await asyncio.shield(self._abort(key, upload_id))
            raise
        await self._abort(key, upload_id)  # an empty file (the store refuses it): nothing to complete

    async def _abort(self, key: str, upload_id: str) -> None:
        try:
            await self._client.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":  # aborted already
                log.warning("s3_abort_failed", key=key, error=repr(exc))

    async def read(self, file_id: str, size: int) -> AsyncIterator[bytes]:
        try:
            found = await self._client.get_object(Bucket=self._bucket, Key=self.key(file_id))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                raise FileGone.of(file_id) from None
            raise
        sent = 0
        async with found["Body"] as body:
            async for piece in body.iter_chunks(READ_BYTES):
                sent += len(piece)
                yield piece
        if sent != size:
            raise FileGone.of(file_id)

    async def delete(self, file_ids: builtins.list[str]) -> None:
        for start in range(0, len(file_ids), _DELETE_BATCH):
            batch = file_ids[start : start + _DELETE_BATCH]
            await self._client.delete_objects(
                Bucket=self._bucket, Delete={"Objects": [{"Key": self.key(i)} for i in batch], "Quiet": True}
            )


@asynccontextmanager
async def open_s3_content(settings: SessionsSettings) -> AsyncIterator[S3Content]:
    """The bucket's client, open while the session manager serves."""
    config = AioConfig(
        connect_timeout=settings.connect_timeout_s,
        read_timeout=_READ_TIMEOUT_S,
        retries={"max_attempts": 3, "mode": "standard"},
    )
    session = get_session()
    async with session.create_client(
        "s3", region_name=settings.file_s3_region, endpoint_url=settings.file_s3_endpoint, config=config
    ) as client:
        yield S3Content(client, bucket=settings.file_s3_bucket, prefix=settings.file_s3_prefix)
