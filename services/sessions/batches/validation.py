"""A batch's input file checked as OpenAI checks it, read in pieces (never whole): each line a
JSON object `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {..., "model"}}`,
every `custom_id` distinct, and neither it nor the model holding U+0000 (PostgreSQL's text cannot).
A file that breaks a rule fails its batch with `errors` naming each
line; what each body asks is judged when its line runs (the online endpoint's checks).
"""

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from shared.openai_requests import MAX_CHOICES
from shared.tokens import estimate_tokens

# The longest line taken (a request body as large as the session manager takes one).
MAX_LINE_BYTES = 64 * 1024 * 1024
# The longest `custom_id`.
MAX_CUSTOM_ID = 512
# The errors a failed batch lists at most (validation stops at this many).
MAX_ERRORS = 100
# The deepest a body may nest arrays and objects: what orjson writes back (the line is stored as
# its body written again).
MAX_BODY_DEPTH = 254
# What one line may count at most (an integer column).
_MAX_LINE_TOKENS = 2**31 - 1
_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True, slots=True)
class BatchLine:
    """A valid line: its number (from 1), `custom_id`, the model its body names and the body (JSON)."""

    line: int
    custom_id: str
    model: str
    body: str
    # The most tokens it may use: its prompt estimated from its body's characters, and its
    # max_tokens (or the default) times n.
    tokens: int


@dataclass(frozen=True, slots=True)
class LineError:
    """Why a line (or the file: `line` None) fails the batch, as OpenAI's batch `errors` list it."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


class TooManyErrors(Exception):
    """Validation stopped at `MAX_ERRORS` errors."""


async def numbered_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    """The file's lines (without their end of line), numbered from 1, from its pieces; a line longer
    than `MAX_LINE_BYTES` comes as its first `MAX_LINE_BYTES + 1` bytes (the rest is dropped)."""
    number, pending, dropping = 0, bytearray(), False
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            number += 1
            if not dropping:
                pending += chunk[start:end]
            yield number, bytes(pending[: MAX_LINE_BYTES + 1])
            pending.clear()
            dropping = False
            start = end + 1
        if not dropping:
            pending += chunk[start:]
            if len(pending) > MAX_LINE_BYTES:
                del pending[MAX_LINE_BYTES + 1 :]
                dropping = True
    if pending:
        yield number + 1, bytes(pending)


class Validator:
    """Checks the lines of one batch's file in order (`check`), remembering the `custom_id`s seen
    (as 16-byte digests, so 50,000 lines hold about 5 MB) and the errors found."""

    def __init__(self, *, endpoint: str, max_lines: int, default_max_tokens: int) -> None:
        self._endpoint = endpoint
        self._max_lines = max_lines
        self._default_max_tokens = default_max_tokens
        self._seen: dict[bytes, int] = {}
        self.errors: list[LineError] = []
        self.lines = 0

    def check(self, number: int, raw: bytes) -> BatchLine | None:
        """The line, if valid (a blank line is skipped: None, no error); an invalid one adds its
        error and is None.

        Raises:
            TooManyErrors: the `MAX_ERRORS`th error was found.
        """
        if not raw.strip():
            return None
        self.lines += 1
        if self.lines > self._max_lines:
            self._fail(LineError("too_many_requests", f"A batch may hold at most {self._max_lines} requests.", number))
            raise TooManyErrors
        line, error = self._parse(number, raw)
        if error is not None:
            self._fail(error)
        return line

    def _parse(self, number: int, raw: bytes) -> tuple[BatchLine | None, LineError | None]:
        if len(raw) > MAX_LINE_BYTES:
            return None, LineError("line_too_large", f"A line may have at most {MAX_LINE_BYTES} bytes.", number)
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None, LineError("invalid_json_line", "This line is not parseable as valid JSON.", number)
        if not isinstance(parsed, dict):
            return None, LineError("invalid_json_line", "This line is not a JSON object.", number)
        if unknown := sorted(parsed.keys() - _LINE_KEYS):
            return None, LineError("invalid_request", f"Unknown field '{unknown[0]}' in the line.", number, unknown[0])
        custom_id = parsed.get("custom_id")
        if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID or "\x00" in custom_id:
            message = f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters, none of them U+0000."
            return None, LineError("invalid_custom_id", message, number, "custom_id")
        if parsed.get("method") != "POST":
            return None, LineError("invalid_method", "The method of each request must be POST.", number, "method")
        if parsed.get("url") != self._endpoint:
            message = f"The url of each request must be the batch's endpoint, {self._endpoint}."
            return None, LineError("invalid_url", message, number, "url")
        body = parsed.get("body")
        if not isinstance(body, dict):
            return None, LineError("invalid_body", "body must be a JSON object (the request).", number, "body")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return None, LineError("missing_model", "The body must name a model.", number, "body.model")
        if "\x00" in model:
            return None, LineError("invalid_model", "The model's name cannot hold U+0000.", number, "body.model")
        digest = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()
        first = self._seen.setdefault(digest, number)
        if first != number:
            message = f"The custom_id '{custom_id}' is also the one of line {first}; each must be unique."
            return None, LineError("duplicate_custom_id", message, number, "custom_id")
        try:
            text = orjson.dumps(body).decode()
        except orjson.JSONEncodeError:
            message = f"body nests arrays and objects more than {MAX_BODY_DEPTH} levels deep."
            return None, LineError("invalid_body", message, number, "body")
        return BatchLine(number, custom_id, model, text, self._most_tokens(body, len(text))), None

    def _most_tokens(self, body: dict[str, Any], chars: int) -> int:
        """A line's most tokens (see `BatchLine.tokens`); a bad value counts as the default (the
        line's run refuses it)."""
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
        max_tokens = asked if type(asked) is int and asked >= 1 else self._default_max_tokens
        n = body.get("n")
        choices = n if type(n) is int and 1 <= n <= MAX_CHOICES else 1
        return min(estimate_tokens(chars=chars) + max_tokens * choices, _MAX_LINE_TOKENS)

    def _fail(self, error: LineError) -> None:
        self.errors.append(error)
        if len(self.errors) >= MAX_ERRORS:
            raise TooManyErrors

    def finish(self) -> None:
        """The file ended: an empty one is an error."""
        if self.lines == 0 and not self.errors:
            self.errors.append(LineError("empty_file", "The input file has no requests."))
