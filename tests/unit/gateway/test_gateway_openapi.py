"""The gateway's OpenAPI schema describes the bodies the session manager accepts.

The gateway forwards bodies raw and may not import the session manager, so `api/openapi.py`
restates its models as JSON Schema; this test (which may import both) fails when they drift.
"""

from typing import Any

import pytest
from pydantic import BaseModel

from services.gateway.api import openapi
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.sessions.api.sessions import SessionCreate, SessionUpdate
from services.sessions.protocol import ChatCompletionRequest, CompletionRequest

_DOC_ONLY = {"title", "description", "examples"}


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """The schema with every `$ref` into `$defs` replaced by its target, and no documentation keys."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k not in _DOC_ONLY and k != "$defs"}
    if isinstance(schema, list):
        return [_inline(item, defs) for item in schema]
    return schema


def _model_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    return _inline(schema, schema.get("$defs", {}))


@pytest.mark.parametrize(
    ("documented", "model"),
    [
        (openapi.CHAT_COMPLETION_REQUEST, ChatCompletionRequest),
        (openapi.COMPLETION_REQUEST, CompletionRequest),
        (openapi.SESSION_CREATE, SessionCreate),
        (openapi.SESSION_UPDATE, SessionUpdate),
    ],
)
def test_documented_bodies_match_the_session_managers_models(documented: dict, model: type[BaseModel]) -> None:
    assert _inline(documented, {}) == _model_schema(model)


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return create_app(GatewaySettings(admin_token="unit-test-admin-token-0123456789")).openapi()


def test_public_routes_document_their_bodies_the_key_and_openai_errors(schema: dict[str, Any]) -> None:
    paths = schema["paths"]
    for path, method in [
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/sessions", "post"),
        ("/v1/sessions/{session_id}", "patch"),
    ]:
        assert paths[path][method]["requestBody"]["content"]["application/json"]["schema"]["type"] == "object"
    assert schema["components"]["securitySchemes"]["apiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "axk_…",
        "description": openapi.bearer_scheme.model.description,
    }
    for path, operations in paths.items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in operations.items():
            assert operation["security"] == [{"apiKey": []}], (method, path)
            # Validation errors are 400 in OpenAI's shape, never FastAPI's 422.
            assert "422" not in operation["responses"], (method, path)
            for status in ("401", "429", "4XX"):
                content = operation["responses"][status]["content"]["application/json"]
                assert content["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
    completions = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(completions) == {"application/json", "text/event-stream"}
