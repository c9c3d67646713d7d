"""OpenAI's published response shapes, checked with `jsonschema`.

`openai_subset.json` beside this file holds the response schemas of OpenAI's own OpenAPI document
(`openai/openai-openapi` `openapi.yaml`, version 2.3.0, the commit in its `x-source` header), in
their OpenAPI 3.0 form so they can be compared with the original line by line. OpenAPI 3.0's
`nullable: true` is not JSON Schema (a validator ignores it and refuses `null`), so the schemas are
converted once at import: `nullable` becomes a `null` type or an `anyOf` with `null`, and
`#/components/schemas/X` references become `#/$defs/X`.

Clients generated from that document (Go, Java, TypeScript) are stricter than the Python SDK,
which accepts a missing field as `None`: `assert_openai_shape` catches what only they would.

The Files, Conversations and Responses APIs are taken from the SDK too (those came after that
version; the Files objects gained fields since), so their shapes (`SDK_SHAPES`) are the JSON Schemas
of the installed `openai` SDK's models, which Stainless generates from OpenAI's current document:
every field the SDK declares without a default is required, `Optional` ones may be null.
"""

import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any, Literal

from jsonschema import Draft202012Validator
from openai.types import FileDeleted, FileObject
from openai.types.conversations import Conversation, ConversationDeletedResource, ConversationItem, ConversationItemList
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

SUBSET_PATH = Path(__file__).with_name("openai_subset.json")

# The schemas a test may name.
SHAPES = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
)


class FileList(BaseModel):
    """A page of `GET /v1/files` (the SDK pages it as a cursor page of `FileObject`s)."""

    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


# The shapes taken from the SDK's models (the Files, Conversations and Responses APIs), by name.
SDK_SHAPES: dict[str, Any] = {
    "FileObject": FileObject,
    "FileDeleted": FileDeleted,
    "FileList": FileList,
    "Conversation": Conversation,
    "ConversationDeletedResource": ConversationDeletedResource,
    "ConversationItem": ConversationItem,
    "ConversationItemList": ConversationItemList,
    "Response": Response,
    "ResponseItemList": ResponseItemList,
    "ResponseStreamEvent": ResponseStreamEvent,
}


def to_json_schema(node: Any) -> Any:
    """An OpenAPI 3.0 Schema Object as JSON Schema 2020-12 (`nullable`, `$ref` paths, `x-` keys)."""
    if isinstance(node, list):
        return [to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if k != "nullable" and not k.startswith("x-")}
    if "$ref" in out:
        out["$ref"] = out["$ref"].replace("#/components/schemas/", "#/$defs/")
    if node.get("nullable") is True:
        if "type" in out and "$ref" not in out and not any(k in out for k in ("oneOf", "anyOf", "allOf")):
            out["type"] = [out["type"], "null"]
            if "enum" in out:
                out["enum"] = [*out["enum"], None]
        else:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


@cache
def _definitions() -> dict[str, Any]:
    document = json.loads(SUBSET_PATH.read_text())
    return {name: to_json_schema(schema) for name, schema in document["components"]["schemas"].items()}


@cache
def _validator(name: str) -> Draft202012Validator:
    if name in SDK_SHAPES:
        schema = TypeAdapter(SDK_SHAPES[name]).json_schema()
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        Draft202012Validator.check_schema(schema)
        return Draft202012Validator(schema)
    if name not in _definitions():
        raise KeyError(f"{name} is not in {SUBSET_PATH.name}")
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": _definitions(),
        "$ref": f"#/$defs/{name}",
    }
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def openai_shape_errors(name: str, body: Any) -> list[str]:
    """Every way `body` departs from OpenAI's schema `name`: `path: message`, empty when it conforms."""
    errors = sorted(_validator(name).iter_errors(body), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def assert_openai_shape(name: str, body: Any) -> None:
    """Fail, listing every departure, unless `body` validates against OpenAI's schema `name`."""
    errors = openai_shape_errors(name, body)
    assert not errors, f"not an OpenAI {name}:\n  " + "\n  ".join(errors) + f"\nbody: {json.dumps(body)[:2000]}"


def sse_payloads(lines: Iterable[str]) -> list[Any]:
    """The JSON payloads of a server-sent event stream's `data:` lines, up to `[DONE]` (required)."""
    payloads: list[Any] = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return payloads
        payloads.append(json.loads(data))
    raise AssertionError("the stream ended without data: [DONE]")


def assert_openai_stream(name: str, lines: Iterable[str]) -> list[Any]:
    """Validate every chunk of an SSE stream against `name` (an error event against ErrorResponse);
    returns the chunks."""
    chunks = sse_payloads(lines)
    for chunk in chunks:
        assert_openai_shape("ErrorResponse" if "error" in chunk else name, chunk)
    return chunks
