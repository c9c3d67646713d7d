"""OpenAI's Files API through the official `openai` client: upload, list, retrieve, download and
delete on the shared stack, every answer checked against OpenAI's shapes; another tenant's key
gets 404; bad uploads are 400 or 413 and leave nothing stored; a file far larger than a piece
streams in and out with the session manager's and the gateway's memory barely moving."""

import asyncio
import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import openai
import pytest
from openai import OpenAI

from services.cli.launcher import Service
from services.sessions.files.s3 import open_s3_content
from services.sessions.settings import SessionsSettings
from shared.keys import KeyLimits
from tests.conftest import create_key
from tests.contract.transport import ContractTransport
from tests.e2e.stack import Stack
from tests.services import ServiceUrls

pytestmark = pytest.mark.e2e

# The bound of the own stack's uploads (`small_gateway`).
SMALL_MAX_BYTES = 64 * 1024
BIG_FILE_BYTES = 80 * 1024 * 1024
# What the session manager's and the gateway's resident memory may grow by while a file of
# BIG_FILE_BYTES goes in and out (pieces of 1 MiB; a process that held the file would grow by it).
RSS_GROWTH_BOUND_BYTES = 24 * 1024 * 1024
LINE = b'{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'


@pytest.fixture
def checked(gateway: Service, api_key: str) -> Iterator[OpenAI]:
    """The SDK client whose every answer is checked against OpenAI's schemas."""
    transport = ContractTransport()
    http = httpx.Client(transport=transport, timeout=120)
    yield OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, http_client=http)
    http.close()
    assert not transport.violations


@pytest.fixture(scope="module")
def other_client(gateway: Service, database_url: str) -> OpenAI:
    key = asyncio.run(create_key(database_url, name="files-other", limits=KeyLimits(), tenant="files-other"))
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def small_gateway(namespace: str, database_url: str, service_urls: ServiceUrls, log_dir: Path) -> Iterator[Service]:
    """A session manager and a gateway of their own that take files of at most SMALL_MAX_BYTES."""
    stack = Stack(
        namespace=namespace,
        database_url=database_url,
        redis_url=service_urls.redis,
        amqp_url=service_urls.amqp,
        log_dir=log_dir,
    )
    small = {"AXON_FILE_MAX_BYTES": str(SMALL_MAX_BYTES)}
    try:
        sessions = stack.start("sessions", env=small)
        yield stack.start("gateway", env={**small, "AXON_SESSIONS_URL": sessions.url})
    finally:
        stack.close()


S3_BUCKET = os.environ.get("AXON_TEST_S3_BUCKET", "axon-test-files")


def _s3_settings(endpoint: str, prefix: str) -> SessionsSettings:
    return SessionsSettings(
        file_store="s3", file_s3_bucket=S3_BUCKET, file_s3_prefix=prefix, file_s3_endpoint=endpoint,
        file_s3_region="us-east-1",
    )  # fmt: skip


async def _s3_objects(settings: SessionsSettings, *, create_bucket: bool = False) -> list[str]:
    """The keys under the settings' prefix (creating the bucket first if asked)."""
    async with open_s3_content(settings) as content:
        client = content._client
        if create_bucket:
            try:
                await client.create_bucket(Bucket=S3_BUCKET)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
        listed = await client.list_objects_v2(Bucket=S3_BUCKET, Prefix=settings.file_s3_prefix)
        return [entry["Key"] for entry in listed.get("Contents", [])]


@pytest.fixture(scope="module")
def s3_stack(
    namespace: str, database_url: str, service_urls: ServiceUrls, log_dir: Path, s3_endpoint: str
) -> Iterator[tuple[Service, SessionsSettings]]:
    """A session manager keeping files in S3 (AXON_FILE_STORE=s3) and its gateway."""
    settings = _s3_settings(s3_endpoint, f"e2e-{uuid.uuid4().hex[:8]}/")
    asyncio.run(_s3_objects(settings, create_bucket=True))
    stack = Stack(
        namespace=namespace,
        database_url=database_url,
        redis_url=service_urls.redis,
        amqp_url=service_urls.amqp,
        log_dir=log_dir,
    )
    s3_env = {
        "AXON_FILE_STORE": "s3",
        "AXON_FILE_S3_BUCKET": S3_BUCKET,
        "AXON_FILE_S3_PREFIX": settings.file_s3_prefix,
        "AXON_FILE_S3_ENDPOINT": s3_endpoint,
        "AXON_FILE_S3_REGION": "us-east-1",
    }
    try:
        sessions = stack.start("sessions", env=s3_env)
        yield stack.start("gateway", env={"AXON_SESSIONS_URL": sessions.url}), settings
    finally:
        stack.close()


def _jsonl(lines: int) -> bytes:
    return b"".join(LINE % i for i in range(lines))


async def _stored_files(database_url: str, tenant: str) -> tuple[int, int]:
    """The tenant's rows in `files` (any status) and `file_parts`."""
    db = await asyncpg.connect(database_url)
    try:
        files = await db.fetchval("SELECT count(*) FROM files WHERE tenant = $1", tenant)
        parts = await db.fetchval(
            "SELECT count(*) FROM file_parts p JOIN files f ON f.id = p.file_id WHERE f.tenant = $1", tenant
        )
        return files, parts
    finally:
        await db.close()


def _wait_stored(database_url: str, expected: tuple[int, int], *, timeout_s: float = 30) -> None:
    """Until the "tests" tenant's rows are `expected` again (an abandoned upload removed)."""
    deadline = time.monotonic() + timeout_s
    while asyncio.run(_stored_files(database_url, "tests")) != expected:
        assert time.monotonic() < deadline, "the abandoned upload was not removed"
        time.sleep(0.1)


def test_file_lifecycle(checked: OpenAI, other_client: OpenAI) -> None:
    content = _jsonl(50)
    created = checked.files.create(file=("requests.jsonl", content), purpose="batch")
    assert created.id.startswith("file-")
    assert created.object == "file" and created.purpose == "batch" and created.status == "processed"
    assert created.bytes == len(content) and created.filename == "requests.jsonl"
    assert created.expires_at == created.created_at + 30 * 86_400  # batch files: 30 days, as OpenAI's
    assert abs(created.created_at - time.time()) < 120

    assert checked.files.retrieve(created.id) == created
    assert checked.files.content(created.id).content == content
    listed = [f.id for f in checked.files.list(purpose="batch", order="desc", limit=100)]
    assert created.id in listed

    # Another tenant's key sees nothing of it.
    for call in (
        lambda: other_client.files.retrieve(created.id),
        lambda: other_client.files.content(created.id),
        lambda: other_client.files.delete(created.id),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["param"] == "file_id"
    assert created.id not in [f.id for f in other_client.files.list()]

    deleted = checked.files.delete(created.id)
    assert deleted.id == created.id and deleted.deleted is True and deleted.object == "file"
    with pytest.raises(openai.NotFoundError):
        checked.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        checked.files.content(created.id)
    with pytest.raises(openai.NotFoundError):
        checked.files.delete(created.id)


def test_list_pages_and_expiry(gateway: Service, database_url: str) -> None:
    key = asyncio.run(create_key(database_url, name="files-pages", limits=KeyLimits(), tenant="files-pages"))
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)
    made = [
        client.files.create(
            file=(f"f{i}.jsonl", _jsonl(1)),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600 + i},
        )
        for i in range(5)
    ]
    assert [f.expires_at - f.created_at for f in made] == [3600 + i for i in range(5)]
    first = client.files.list(limit=2, order="asc")
    assert [f.id for f in first.data] == [f.id for f in made[:2]] and first.has_more
    # The SDK's pager follows `after` with the last id of each page.
    assert [f.id for f in first] == [f.id for f in made]
    assert [f.id for f in client.files.list(limit=2)] == [f.id for f in reversed(made)]
    assert [f.id for f in client.files.list(purpose="batch_output")] == []
    raw = httpx.get(
        f"{gateway.url}/v1/files", params={"limit": 3, "after": made[4].id}, headers={"authorization": f"Bearer {key}"}
    ).json()
    assert raw["object"] == "list" and raw["has_more"]  # made[0] follows
    assert [f["id"] for f in raw["data"]] == [f.id for f in reversed(made[:4])][:3]
    assert raw["first_id"] == made[3].id and raw["last_id"] == made[1].id


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"purpose": "fine-tune"}, "purpose"),
        ({"purpose": "batch_output"}, "purpose"),
        ({"purpose": "batch", "expires_after": {"anchor": "created_at", "seconds": 60}}, "expires_after.seconds"),
    ],
)
def test_refused_uploads_are_400(checked: OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        checked.files.create(file=("x.jsonl", b"{}\n"), **kwargs)
    assert refused.value.body["param"] == param
    assert refused.value.body["type"] == "invalid_request_error"


def test_empty_file_is_400(checked: OpenAI, api_key: str, database_url: str) -> None:
    before = asyncio.run(_stored_files(database_url, "tests"))
    with pytest.raises(openai.BadRequestError) as refused:
        checked.files.create(file=("empty.jsonl", b""), purpose="batch")
    assert refused.value.body["code"] == "empty_file" and refused.value.body["param"] == "file"
    assert asyncio.run(_stored_files(database_url, "tests")) == before


def _post(gateway: Service, api_key: str, content: bytes, content_type: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/files",
        content=content,
        headers={"authorization": f"Bearer {api_key}", "content-type": content_type},
        timeout=30,
    )


_FORM = "multipart/form-data; boundary=XyZ"


@pytest.mark.parametrize(
    ("content_type", "body", "code", "param"),
    [
        ("application/json", b'{"purpose": "batch"}', "invalid_content_type", None),
        ("multipart/form-data", b"--XyZ--\r\n", "invalid_content_type", None),
        # Boundaries longer than RFC 2046's 70 characters (70 is taken: the next test).
        (f"multipart/form-data; boundary={'b' * 71}", b"--" + b"b" * 71 + b"--\r\n", "invalid_content_type", None),
        (f"multipart/form-data; boundary={'b' * 257}", b"--" + b"b" * 257 + b"--\r\n", "invalid_content_type", None),
        (f"multipart/form-data; boundary={'b' * 5000}", b"--" + b"b" * 5000 + b"--\r\n", "invalid_content_type", None),
        (_FORM, b"this is not multipart at all", "invalid_multipart", None),
        # The body ends before its closing boundary.
        (
            _FORM,
            b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\n',
            "invalid_multipart",
            None,
        ),
        # The file before its purpose.
        (
            _FORM,
            b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\n\r\n'
            b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XyZ--\r\n',
            "missing_required_parameter",
            "purpose",
        ),
        (
            _FORM,
            b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XyZ--\r\n',
            "missing_required_parameter",
            "file",
        ),
        (
            _FORM,
            b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--XyZ--\r\n',
            None,
            "model",
        ),
        # Something after the file: the file is not kept.
        (
            _FORM,
            b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\n\r\n'
            b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XyZ--\r\n',
            "invalid_multipart",
            None,
        ),
    ],
)
def test_malformed_uploads_are_400(
    gateway: Service, api_key: str, database_url: str, content_type: str, body: bytes, code: str | None, param: str
) -> None:
    before = asyncio.run(_stored_files(database_url, "tests"))
    response = _post(gateway, api_key, body, content_type)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] == param
    assert asyncio.run(_stored_files(database_url, "tests")) == before


def test_a_boundary_of_rfc_2046s_70_characters_is_taken(gateway: Service, api_key: str) -> None:
    dashes = b"--" + b"b" * 70
    body = (
        dashes + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        + dashes + b'\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\n\r\n'
        + dashes + b"--\r\n"
    )  # fmt: skip
    response = _post(gateway, api_key, body, f"multipart/form-data; boundary={'b' * 70}")
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] == 3


def test_over_the_limit_is_413_and_keeps_nothing(small_gateway: Service, api_key: str, database_url: str) -> None:
    client = OpenAI(base_url=f"{small_gateway.url}/v1", api_key=api_key, max_retries=0, timeout=30)
    before = asyncio.run(_stored_files(database_url, "tests"))
    just = client.files.create(file=("just.jsonl", b"x" * SMALL_MAX_BYTES), purpose="batch")
    assert just.bytes == SMALL_MAX_BYTES
    client.files.delete(just.id)
    # Refused by the session manager as the file passes the limit (the form's overhead lets the
    # body through the gateway) ...
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("over.jsonl", b"x" * (SMALL_MAX_BYTES + 1)), purpose="batch")
    assert refused.value.status_code == 413
    assert refused.value.body["code"] == "file_too_large" and refused.value.body["param"] == "file"
    # ... by the gateway from its Content-Length, before anything is forwarded ...
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("far.jsonl", b"x" * (4 * SMALL_MAX_BYTES)), purpose="batch")
    assert refused.value.status_code == 413 and refused.value.body["code"] == "file_too_large"

    # ... and by the gateway as it streams a body sent without a Content-Length.
    def chunked() -> Iterator[bytes]:
        yield b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="c.jsonl"\r\n\r\n'
        for _ in range(8):
            yield b"y" * SMALL_MAX_BYTES
        yield b"\r\n--XyZ--\r\n"

    response = httpx.post(
        f"{small_gateway.url}/v1/files",
        content=chunked(),
        headers={"authorization": f"Bearer {api_key}", "content-type": _FORM},
        timeout=30,
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "file_too_large"
    # That upload's start reached the session manager, which removes it once its connection breaks.
    _wait_stored(database_url, before)


def test_files_in_s3_through_the_stack(s3_stack: tuple[Service, SessionsSettings], api_key: str) -> None:
    gateway, settings = s3_stack
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=60)
    content = os.urandom(9 * 1024 * 1024)  # two parts of the multipart upload
    created = client.files.create(file=("s3.jsonl", content), purpose="batch")
    assert created.bytes == len(content)
    assert asyncio.run(_s3_objects(settings)) == [settings.file_s3_prefix + created.id]
    assert client.files.content(created.id).content == content
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("empty.jsonl", b""), purpose="batch")
    assert refused.value.status_code == 400
    client.files.delete(created.id)
    assert asyncio.run(_s3_objects(settings)) == []
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)


def test_a_client_gone_mid_upload_leaves_nothing(gateway: Service, api_key: str, database_url: str) -> None:
    before = asyncio.run(_stored_files(database_url, "tests"))
    head = (
        b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="gone.jsonl"\r\n\r\n'
    )
    sent = 3 * 1024 * 1024  # three pieces stored before the client goes
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n"
            % (api_key.encode(), _FORM.encode(), len(head) + 10 * sent)
        )
        conn.sendall(head + b"z" * sent)
        deadline = time.monotonic() + 30
        while asyncio.run(_stored_files(database_url, "tests"))[1] <= before[1] + 1:  # its pieces arriving
            assert time.monotonic() < deadline, "the upload's pieces never reached the store"
            time.sleep(0.1)
    _wait_stored(database_url, before)


def _rss_bytes(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


class _PeakRss:
    """The highest resident memory of some processes while the block runs, sampled every 20 ms."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self.start = {name: _rss_bytes(pid) for name, pid in pids.items()}
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            for name, pid in self._pids.items():
                self.peak[name] = max(self.peak[name], _rss_bytes(pid))

    def __enter__(self) -> "_PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def growth(self) -> dict[str, int]:
        return {name: self.peak[name] - self.start[name] for name in self._pids}


@pytest.mark.timeout(300)
def test_a_large_file_streams_in_and_out_in_bounded_memory(
    client: OpenAI, gateway: Service, sessions: Service, tmp_path: Path
) -> None:
    path = tmp_path / "big.jsonl"
    digest = hashlib.sha256()
    with path.open("wb") as out:
        block = _jsonl(20_000)
        written = 0
        while written < BIG_FILE_BYTES:
            piece = block[: BIG_FILE_BYTES - written]
            out.write(piece)
            digest.update(piece)
            written += len(piece)
    client = client.with_options(timeout=240)
    with _PeakRss({"sessions": sessions.pid, "gateway": gateway.pid}) as rss:
        with path.open("rb") as upload:
            created = client.files.create(file=upload, purpose="batch")
        assert created.bytes == BIG_FILE_BYTES and created.filename == "big.jsonl"
        downloaded = hashlib.sha256()
        size = 0
        with client.files.with_streaming_response.content(created.id) as response:
            for piece in response.iter_bytes():
                downloaded.update(piece)
                size += len(piece)
    client.files.delete(created.id)
    assert size == BIG_FILE_BYTES and downloaded.hexdigest() == digest.hexdigest()
    growth = rss.growth()
    print(
        f"RSS growth through a {BIG_FILE_BYTES >> 20} MiB upload and download: "
        + ", ".join(f"{name} {value / 2**20:.1f} MiB" for name, value in growth.items())
    )
    assert all(value < RSS_GROWTH_BOUND_BYTES for value in growth.values()), growth
