"""The gateway's root and favicon (services/gateway/api/landing.py)."""

from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings


def _app():  # type: ignore[no-untyped-def]
    return create_app(
        GatewaySettings(
            admin_token="unit-test-admin-token-0123456789", internal_token="unit-test-internal-token-0123456789"
        )
    )


def test_the_root_points_to_the_playground_the_docs_and_the_api_base() -> None:
    answer = TestClient(_app(), base_url="http://127.0.0.1:8000").get("/")
    assert answer.status_code == 200
    body = answer.json()
    assert body["api_base_url"] == "http://127.0.0.1:8000/v1"
    assert body["playground"] == "http://127.0.0.1:8000/playground"
    assert body["docs"] == "http://127.0.0.1:8000/docs"
    assert body["openapi"] == "http://127.0.0.1:8000/openapi.json"


def test_the_favicon_is_an_empty_answer_not_a_404() -> None:
    answer = TestClient(_app()).get("/favicon.ico")
    assert answer.status_code == 204 and answer.content == b""


def test_neither_is_in_the_openapi_document() -> None:
    paths = _app().openapi()["paths"]
    assert "/" not in paths and "/favicon.ico" not in paths
