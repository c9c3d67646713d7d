"""A batch's file checked as OpenAI checks it, read in pieces (`services/sessions/batches/validation.py`)."""

from collections.abc import AsyncIterator

import orjson
import pytest

from services.sessions.batches import validation
from services.sessions.batches.validation import TooManyErrors, Validator, numbered_lines

CHAT = "/v1/chat/completions"


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _lines(data: bytes, size: int) -> list[tuple[int, bytes]]:
    return [line async for line in numbered_lines(_pieces(data, size))]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
async def test_lines_are_the_same_whatever_the_pieces(size: int) -> None:
    data = b"first\n\nthird line\r\nlast without end"
    assert await _lines(data, size) == [(1, b"first"), (2, b""), (3, b"third line\r"), (4, b"last without end")]


async def test_a_line_past_the_limit_is_cut_and_the_next_lines_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "MAX_LINE_BYTES", 8)
    lines = await _lines(b"0123456789abcdef\nok\n", 3)
    assert lines == [(1, b"012345678"), (2, b"ok")]


def _line(custom_id: str = "a", **fields: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body, **fields})


def _nested_line(depth: int, custom_id: str = "deep") -> bytes:
    """A line whose body nests arrays `depth` levels deep (the body itself the first)."""
    nested = "[" * (depth - 1) + "]" * (depth - 1)
    return b'{"custom_id": "%s", "method": "POST", "url": "%s", "body": {"model": "m", "x": %s}}' % (
        custom_id.encode(),
        CHAT.encode(),
        nested.encode(),
    )


def _check(*raw: bytes, max_lines: int = 100) -> Validator:
    validator = Validator(endpoint=CHAT, max_lines=max_lines, default_max_tokens=256)
    for number, line in enumerate(raw, 1):
        validator.check(number, line)
    validator.finish()
    return validator


def test_a_valid_line_keeps_its_body_model_and_most_tokens() -> None:
    validator = Validator(endpoint=CHAT, max_lines=10, default_max_tokens=256)
    line = validator.check(4, _line("x", body={"model": "m2", "prompt": "p", "max_tokens": 7, "n": 2}))
    assert line is not None
    assert (line.line, line.custom_id, line.model) == (4, "x", "m2")
    assert orjson.loads(line.body) == {"model": "m2", "prompt": "p", "max_tokens": 7, "n": 2}
    assert line.tokens == -(-len(line.body) // 4) + 14


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"{nope", "invalid_json_line", None),
        (b"[1, 2]", "invalid_json_line", None),
        (_line(extra=1), "invalid_request", "extra"),
        (_line(""), "invalid_custom_id", "custom_id"),
        (_line(method="GET"), "invalid_method", "method"),
        (_line(url="/v1/completions"), "invalid_url", "url"),
        (_line(body=[]), "invalid_body", "body"),
        (_line(body={"messages": []}), "missing_model", "body.model"),
        (_line("a\x00b"), "invalid_custom_id", "custom_id"),
        (_line(body={"model": "m\x00"}), "invalid_model", "body.model"),
        (_nested_line(300), "invalid_body", "body"),
    ],
)
def test_each_broken_rule_names_its_line(raw: bytes, code: str, param: str | None) -> None:
    errors = _check(_line("a"), raw).errors
    assert [(e.code, e.line, e.param) for e in errors] == [(code, 2, param)]


def test_a_body_as_deep_as_the_limit_is_valid() -> None:
    assert _check(_nested_line(validation.MAX_BODY_DEPTH)).errors == []
    assert [e.code for e in _check(_nested_line(validation.MAX_BODY_DEPTH + 1)).errors] == ["invalid_body"]


def test_a_duplicate_custom_id_names_both_lines_and_blank_lines_count() -> None:
    errors = _check(_line("a"), b"  ", _line("b"), _line("a")).errors
    assert [(e.code, e.line) for e in errors] == [("duplicate_custom_id", 4)]
    assert "line 1" in errors[0].message


def test_an_empty_file_and_too_many_lines() -> None:
    assert [e.code for e in _check(b"", b"\t").errors] == ["empty_file"]
    with pytest.raises(TooManyErrors):
        _check(_line("a"), _line("b"), _line("c"), max_lines=2)


def test_validation_stops_at_the_most_errors() -> None:
    validator = Validator(endpoint=CHAT, max_lines=1000, default_max_tokens=256)
    with pytest.raises(TooManyErrors):
        for number in range(1, 200):
            validator.check(number, b"{")
    assert len(validator.errors) == validation.MAX_ERRORS
