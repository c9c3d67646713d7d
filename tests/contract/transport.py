"""An httpx transport that checks every OpenAI answer passing through it against OpenAI's schemas.

Hand it to any client built on httpx (the `openai` SDK, instructor through the SDK, LangChain's
`ChatOpenAI(http_client=...)`) and every answer body, every server-sent chunk and every error body
those clients receive is validated on the way (`openai_shapes.py`), without the test collecting
them itself. A departure raises in the client at once and is also kept in `violations`, so a
library that swallows exceptions cannot hide it.
"""

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx

from tests.contract.openai_shapes import openai_shape_errors

_RESPONSES_ENDS = ("response.completed", "response.incomplete", "response.failed")
_MODEL_PATH = re.compile(r"/v1/models/[^/]+$")
_RESPONSE_PATH = re.compile(r"/v1/responses(?:/(?P<id>[^/]+)(?P<items>/input_items)?)?$")
_FILE_PATH = re.compile(r"/v1/files(?:/(?P<id>[^/]+)(?P<content>/content)?)?$")
_CONVERSATION_PATH = re.compile(r"/v1/conversations(?:/(?P<id>[^/]+)(?P<items>/items)?(?P<item>/[^/]+)?)?$")


def shape_for(path: str, status: int, *, streamed: bool, method: str = "GET") -> str | None:
    """The OpenAI schema an answer to `method` `path` with `status` must follow (None: not an
    OpenAI route)."""
    if not path.startswith("/v1/"):
        return None
    if status >= 400:
        return "ErrorResponse"
    if file := _FILE_PATH.search(path):
        return _file_shape(file, method)
    if conversation := _CONVERSATION_PATH.search(path):
        if conversation["item"]:  # one item; deleting it answers the conversation
            return "Conversation" if method == "DELETE" else "ConversationItem"
        if conversation["items"]:
            return "ConversationItemList"
        return "ConversationDeletedResource" if method == "DELETE" else "Conversation"
    if response := _RESPONSE_PATH.search(path):
        if response["items"]:
            return "ResponseItemList"
        if streamed:
            return "ResponseStreamEvent"
        return None if method == "DELETE" else "Response"  # deleting answers no OpenAI object
    if path.endswith("/chat/completions"):
        return "CreateChatCompletionStreamResponse" if streamed else "CreateChatCompletionResponse"
    if path.endswith("/completions"):
        return "CreateCompletionResponse"  # streamed chunks share the answer's shape
    if path == "/v1/models":
        return "ListModelsResponse"
    if _MODEL_PATH.search(path):
        return "Model"
    return None


def _file_shape(file: re.Match[str], method: str) -> str | None:
    if file["content"]:
        return None  # the file's own bytes
    if file["id"]:
        return "FileDeleted" if method == "DELETE" else "FileObject"
    return "FileObject" if method == "POST" else "FileList"


class ContractTransport(httpx.BaseTransport):
    """Forwards to a real transport; validates every OpenAI answer body and chunk it returns."""

    def __init__(self, inner: httpx.BaseTransport | None = None) -> None:
        self._inner = inner or httpx.HTTPTransport()
        self.violations: list[str] = []
        # How many bodies (answers, chunks, errors) were validated, by schema name.
        self.checked: dict[str, int] = {}

    def check(self, shape: str, body: Any, where: str) -> None:
        if shape == "CreateChatCompletionStreamResponse" and isinstance(body, dict) and "error" in body:
            shape = "ErrorResponse"  # an error event ends a broken stream
        self.checked[shape] = self.checked.get(shape, 0) + 1
        errors = openai_shape_errors(shape, body)
        if errors:
            message = f"{where}: not an OpenAI {shape}: {errors}; body: {json.dumps(body)[:1000]}"
            self.violations.append(message)
            raise AssertionError(message)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        shape = shape_for(request.url.path, response.status_code, streamed=streamed, method=request.method)
        if shape is None:
            return response
        where = f"{request.method} {request.url.path} {response.status_code}"
        if streamed:
            stream = _CheckedStream(response, shape, self, where)
            return httpx.Response(
                response.status_code, headers=response.headers, stream=stream, extensions=response.extensions
            )
        response.read()
        self.check(shape, response.json(), where)
        return response

    def close(self) -> None:
        self._inner.close()


class _CheckedStream(httpx.SyncByteStream):
    """The answer's bytes unchanged, each `data:` event validated as it goes by."""

    def __init__(self, response: httpx.Response, shape: str, transport: ContractTransport, where: str) -> None:
        self._response = response
        self._shape = shape
        self._transport = transport
        self._where = where
        self._buffer = b""
        self._done = False

    def __iter__(self) -> Iterator[bytes]:
        for data in self._response.stream:
            self._feed(data)
            yield data
        if not self._done:
            message = f"{self._where}: the stream ended without data: [DONE] (or a Responses stream's last event)"
            self._transport.violations.append(message)
            raise AssertionError(message)

    def _feed(self, data: bytes) -> None:
        lines = (self._buffer + data).split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self._done = True
            else:
                body = json.loads(payload)
                self._transport.check(self._shape, body, self._where + " chunk")
                # A Responses stream has no [DONE]: its last event is the end.
                if self._shape == "ResponseStreamEvent" and body.get("type") in _RESPONSES_ENDS:
                    self._done = True

    def close(self) -> None:
        self._response.close()


def contract_client(**kwargs: Any) -> tuple[httpx.Client, ContractTransport]:
    """An httpx client whose every OpenAI answer is validated, and its transport (for `violations`)."""
    transport = ContractTransport()
    return httpx.Client(transport=transport, **kwargs), transport
