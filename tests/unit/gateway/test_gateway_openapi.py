"""The gateway's OpenAPI schema: generated from the session manager's own request models, the
bearer key and OpenAI's error shape on every public route."""

from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

from services.gateway.api import openapi
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from shared.conversation_requests import ConversationCreate, ConversationItemsCreate, ConversationUpdate
from shared.messages_requests import CountTokensRequest, MessageCreate
from shared.openai_requests import ChatCompletionRequest, CompletionRequest
from shared.session_requests import SessionCreate, SessionUpdate


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return create_app(
        GatewaySettings(
            admin_token="unit-test-admin-token-0123456789", internal_token="unit-test-internal-token-0123456789"
        )
    ).openapi()


def _validator(schema: dict[str, Any], path: str, method: str) -> jsonschema.Draft202012Validator:
    """A validator of the body `path` documents, resolving `$ref`s in the whole document."""
    body = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**body, "components": schema["components"]})


@pytest.mark.parametrize(
    ("path", "method", "model"),
    [
        ("/v1/chat/completions", "post", ChatCompletionRequest),
        ("/v1/completions", "post", CompletionRequest),
        ("/v1/sessions", "post", SessionCreate),
        ("/v1/sessions/{session_id}", "patch", SessionUpdate),
        ("/v1/conversations", "post", ConversationCreate),
        ("/v1/conversations/{conversation_id}", "post", ConversationUpdate),
        ("/v1/conversations/{conversation_id}/items", "post", ConversationItemsCreate),
        ("/v1/messages", "post", MessageCreate),
        ("/v1/messages/count_tokens", "post", CountTokensRequest),
    ],
)
def test_bodies_are_documented_by_the_models_that_validate_them(
    schema: dict[str, Any], path: str, method: str, model: type[BaseModel]
) -> None:
    body = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": f"#/components/schemas/{model.__name__}"}
    generated = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in {**generated.pop("$defs", {}), model.__name__: generated}.items():
        assert schema["components"]["schemas"][name] == definition, name


def test_the_documented_chat_body_takes_what_clients_send_and_refuses_unknown_fields(schema: dict[str, Any]) -> None:
    validator = _validator(schema, "/v1/chat/completions", "post")
    tool = {"type": "function", "function": {"name": "Weather", "parameters": {"type": "object"}}}
    validator.validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "Weather", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "c", "content": "18C"},
            ],
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "Weather"}},
            "response_format": {"type": "json_schema", "json_schema": {"name": "W", "schema": {}, "strict": True}},
            "logprobs": True,
            "top_logprobs": 20,
            "logit_bias": {"50256": -100},
            "n": 8,
            "stop": ["a", "b"],
        }
    )
    for bad in (
        {"model": "m", "messages": [], "unknown": 1},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
    ):
        assert not validator.is_valid(bad), bad


def test_public_routes_document_their_bodies_the_key_and_their_errors(schema: dict[str, Any]) -> None:
    paths = schema["paths"]
    assert "/v1/models/{model_id}" in paths
    assert schema["components"]["securitySchemes"]["apiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "axk_…",
        "description": openapi.bearer_scheme.model.description,
    }
    for path, operations in paths.items():
        if not path.startswith("/v1/"):
            continue
        anthropic = path.startswith("/v1/messages")
        for method, operation in operations.items():
            # Anthropic's routes also take the key in `x-api-key`, as Anthropic's clients send it.
            keys = [{"apiKey": []}, {"anthropicApiKey": []}] if anthropic else [{"apiKey": []}]
            assert operation["security"] == keys, (method, path)
            # Validation errors are 400 (in OpenAI's shape, or Anthropic's on its routes), never FastAPI's 422.
            assert "422" not in operation["responses"], (method, path)
            error = "AnthropicErrorResponse" if anthropic else "ErrorResponse"
            for status in ("401", "429", "4XX"):
                content = operation["responses"][status]["content"]["application/json"]
                assert content["schema"] == {"$ref": f"#/components/schemas/{error}"}, (method, path, status)
    assert schema["components"]["securitySchemes"]["anthropicApiKey"]["name"] == "x-api-key"
    assert "529" in paths["/v1/messages"]["post"]["responses"]
    completions = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(completions) == {"application/json", "text/event-stream"}


def test_every_operation_is_in_one_section_and_the_admin_api_is_documented(schema: dict[str, Any]) -> None:
    names = [tag["name"] for tag in openapi.TAGS]
    assert [tag["name"] for tag in schema["tags"]] == names
    sections: dict[str, set[str]] = {}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert len(operation["tags"]) == 1 and operation["tags"][0] in names, (method, path)
            sections.setdefault(operation["tags"][0], set()).add(path)
    assert set(sections) == set(names)  # no section is empty, none is "default"
    assert "/v1/chat/completions" in sections["Chat"] and "/v1/completions" in sections["Completions"]
    assert "/v1/models" in sections["Models"] and "/health" in sections["Operations"]
    assert "/v1/files" in sections["Files"] and "/v1/batches" in sections["Batches"]
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= sections["Messages"]
    admin = sections["Admin"]
    assert {"/admin/keys", "/admin/keys/{key_id}", "/admin/usage", "/admin/models/aliases"} <= admin
    assert {"/admin/tenants", "/admin/tenants/{tenant}"} <= admin
    # The fuzzing of tests/e2e/test_fuzz.py takes only ^/v1/: never the admin API.
    assert not any(path.startswith("/v1/") for path in admin)
    assert schema["components"]["securitySchemes"]["adminToken"]["scheme"] == "bearer"
    for path in admin:
        for method, operation in schema["paths"][path].items():
            assert operation["security"] == [{"adminToken": []}], (method, path)
            assert "422" not in operation["responses"], (method, path)  # refusals are 400s in OpenAI's shape
            assert operation["summary"] and operation["description"], (method, path)  # the route's docstring
            assert operation["responses"]["401"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"
            }
