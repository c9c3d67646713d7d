"""An upload's multipart body read as it arrives, however the network cuts it, and its fields
checked (`services/sessions/files/multipart.py`, `protocol.py`)."""

import random
from collections.abc import AsyncIterator

import pytest

from services.sessions.files.multipart import MultipartReader, Part, boundary_of
from services.sessions.files.protocol import check_filename, check_purpose, expires_after_s
from shared.errors import InvalidRequest

BOUNDARY = b"----axonBoundary7MA4YWxkTrZu0gW"
FILE = bytes(range(256)) * 40 + b"\r\n--not-the-boundary\r\n" + b"tail"
BODY = (
    b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
    b"Content-Type: application/octet-stream\r\n\r\n" + FILE + b"\r\n--" + BOUNDARY + b"--\r\n"
)


async def _pieces(body: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    start = 0
    for cut in [*cuts, len(body)]:
        yield body[start:cut]
        start = cut


async def _read_all(reader: MultipartReader) -> list[tuple[Part, bytes]]:
    parts = []
    while (part := await reader.next_part()) is not None:
        parts.append((part, b"".join([piece async for piece in reader.data()])))
    return parts


def _cuttings() -> list[list[int]]:
    rng = random.Random(7)
    every_byte = list(range(1, len(BODY)))
    return [[], every_byte, *(sorted(rng.sample(every_byte, k)) for k in (1, 3, 17, 200))]


@pytest.mark.parametrize("cuts", _cuttings(), ids=lambda cuts: f"{len(cuts) + 1}-pieces")
async def test_parts_are_the_same_however_the_body_is_cut(cuts: list[int]) -> None:
    reader = MultipartReader(_pieces(BODY, cuts), BOUNDARY)
    assert await _read_all(reader) == [
        (Part(name="purpose", filename=None), b"batch"),
        (Part(name="file", filename="in.jsonl"), FILE),
    ]


async def test_text_fields_are_bounded() -> None:
    reader = MultipartReader(_pieces(BODY, []), BOUNDARY)
    assert await reader.next_part() == Part(name="purpose", filename=None)
    with pytest.raises(InvalidRequest) as refused:
        await reader.text(max_bytes=3)
    assert refused.value.code == "invalid_multipart"


async def test_a_part_left_unread_is_skipped() -> None:
    reader = MultipartReader(_pieces(BODY, list(range(1, len(BODY), 5))), BOUNDARY)
    await reader.next_part()
    part = await reader.next_part()
    assert part is not None and part.name == "file"
    assert await reader.next_part() is None
    assert await reader.next_part() is None


@pytest.mark.parametrize(
    "body",
    [
        BODY[: len(BODY) // 2],  # cut short
        b"garbage that is not multipart",
        b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data\r\n\r\nx\r\n--" + BOUNDARY + b"--\r\n",  # no name
    ],
    ids=["cut-short", "garbage", "nameless-part"],
)
async def test_malformed_bodies_are_400(body: bytes) -> None:
    reader = MultipartReader(_pieces(body, []), BOUNDARY)
    with pytest.raises(InvalidRequest) as refused:
        await _read_all(reader)
    assert refused.value.code == "invalid_multipart"


@pytest.mark.parametrize(
    "content_type",
    [None, "application/json", "multipart/form-data", "multipart/mixed; boundary=x", "text/plain; boundary=x"],
)
def test_only_multipart_form_data_with_a_boundary(content_type: str | None) -> None:
    with pytest.raises(InvalidRequest) as refused:
        boundary_of(content_type)
    assert refused.value.code == "invalid_content_type"


def test_boundary_is_read_quoted_or_not() -> None:
    assert boundary_of('multipart/form-data; boundary="a b"') == b"a b"
    assert boundary_of("Multipart/Form-Data; charset=utf-8; boundary=xyz") == b"xyz"


def test_purpose_is_batch_only() -> None:
    assert check_purpose({"purpose": "batch"}) == "batch"
    for fields, code in (({}, "missing_required_parameter"), ({"purpose": "user_data"}, "invalid_value")):
        with pytest.raises(InvalidRequest) as refused:
            check_purpose(fields)
        assert (refused.value.code, refused.value.param) == (code, "purpose")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}, 3600),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592000"}, 2_592_000),
    ],
)
def test_expires_after(fields: dict[str, str], expected: int | None) -> None:
    assert expires_after_s(fields) == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "expires_after.anchor"),
        ({"expires_after[anchor]": "created_at"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "-5"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1e4"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600\u00b3"}, "expires_after.seconds"),
    ],
)
def test_bad_expires_after_is_a_400_naming_it(fields: dict[str, str], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        expires_after_s(fields)
    assert refused.value.param == param


def test_filename() -> None:
    assert check_filename("in.jsonl") == "in.jsonl"
    for bad in (None, "x" * 1025):
        with pytest.raises(InvalidRequest) as refused:
            check_filename(bad)
        assert refused.value.param == "file"
