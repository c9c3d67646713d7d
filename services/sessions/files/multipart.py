"""A `multipart/form-data` body read as it arrives (python-multipart's incremental parser): each
part's headers, then its bytes as they come, so an upload's file streams into the store while
the rest of the body is still on its way. Memory: what one received piece of the body holds."""

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from shared.errors import InvalidRequest

if TYPE_CHECKING:  # a TypedDict python-multipart declares for type checkers only
    from python_multipart.multipart import MultipartCallbacks

MALFORMED = "The request body is not valid multipart/form-data."
# RFC 2046 section 5.1.1: a boundary has 1 to 70 characters.
MAX_BOUNDARY = 70


def malformed(reason: str = "") -> InvalidRequest:
    return InvalidRequest(f"{MALFORMED} {reason}".strip(), code="invalid_multipart")


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a `multipart/form-data` Content-Type.

    Raises:
        InvalidRequest: another type, or no boundary, or one longer than RFC 2046 allows.
    """
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidRequest(
            "The request body must be multipart/form-data (with a boundary).", code="invalid_content_type"
        )
    if len(boundary) > MAX_BOUNDARY:
        raise InvalidRequest(
            f"The multipart boundary has {len(boundary)} characters; RFC 2046 allows at most {MAX_BOUNDARY}.",
            code="invalid_content_type",
        )
    return boundary


@dataclass(frozen=True, slots=True)
class Part:
    """A part's `name` and, for a file, `filename` (from its Content-Disposition)."""

    name: str
    filename: str | None


_BEGIN, _HEADER, _HEADERS, _DATA, _PART_END, _END = range(6)


class MultipartReader:
    """Parts of a multipart body, in order: `next_part()` for each part's head, then `data()` or
    `text()` for its content (a part's content left unread is skipped by the next `next_part()`).

    Raises (from every method):
        InvalidRequest: the body is not valid multipart (or ends early), or a header is too large.
    """

    def __init__(self, body: AsyncIterator[bytes], boundary: bytes) -> None:
        self._body = body
        self._events: deque[tuple[int, bytes]] = deque()
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._in_part = False
        self._ended = False
        callbacks: MultipartCallbacks = {
            "on_part_begin": lambda: self._events.append((_BEGIN, b"")),
            "on_header_field": lambda data, start, end: self._header_name.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self._header_value.extend(data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": lambda: self._events.append((_HEADERS, b"")),
            "on_part_data": lambda data, start, end: self._events.append((_DATA, bytes(data[start:end]))),
            "on_part_end": lambda: self._events.append((_PART_END, b"")),
            "on_end": lambda: self._events.append((_END, b"")),
        }
        self._parser = MultipartParser(boundary, callbacks)

    def _header_end(self) -> None:
        # A header is an event too: the parser may go through several parts in one write.
        self._events.append((_HEADER, bytes(self._header_name) + b":" + bytes(self._header_value)))
        self._header_name.clear()
        self._header_value.clear()

    async def _event(self) -> tuple[int, bytes]:
        """The parser's next event, reading more of the body when it has none."""
        while not self._events:
            try:
                chunk = await anext(self._body)
            except StopAsyncIteration:
                raise malformed("It ends before its closing boundary.") from None
            try:
                self._parser.write(chunk)
            except MultipartParseError as exc:
                raise malformed(str(exc)) from None
        return self._events.popleft()

    async def next_part(self) -> Part | None:
        """The next part's head, None after the last part."""
        if self._ended:
            return None
        while True:
            kind, data = await self._event()
            if kind == _END:
                self._ended = True
                return None
            if kind == _BEGIN:
                self._headers = {}
            elif kind == _HEADER:
                name, _, value = data.partition(b":")
                self._headers[name.decode("latin-1").lower()] = value
            elif kind == _HEADERS:
                self._in_part = True
                return self._part()

    def _part(self) -> Part:
        _, options = parse_options_header(self._headers.get("content-disposition"))
        name = options.get(b"name")
        if name is None:
            raise malformed("A part has no name in its Content-Disposition.")
        filename = options.get(b"filename")
        return Part(
            name=name.decode("utf-8", "replace"),
            filename=None if filename is None else filename.decode("utf-8", "replace"),
        )

    async def data(self) -> AsyncIterator[bytes]:
        """The current part's bytes as they arrive."""
        while self._in_part:
            kind, data = await self._event()
            if kind == _DATA:
                if data:
                    yield data
            elif kind == _PART_END:
                self._in_part = False

    async def text(self, *, max_bytes: int) -> str:
        """The current part's content as UTF-8 text.

        Raises:
            InvalidRequest: longer than `max_bytes`, or not UTF-8.
        """
        content = bytearray()
        async for piece in self.data():
            content += piece
            if len(content) > max_bytes:
                raise malformed(f"A form field is longer than {max_bytes} bytes.")
        try:
            return content.decode("utf-8")
        except UnicodeDecodeError:
            raise malformed("A form field is not UTF-8 text.") from None

    async def skip_rest(self) -> None:
        """Read the body to its end, keeping nothing (so that the answer is not sent while the
        client is still sending)."""
        async for _ in self._body:
            pass
