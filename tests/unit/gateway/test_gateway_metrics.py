"""The gateway's /metrics, on the public port, answers only with the internal token (unless
AXON_METRICS_PUBLIC says its port is a private scrape network's)."""

import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

TOKEN = "unit-test-internal-token-0123456789"


def _client(*, metrics_public: bool) -> TestClient:
    settings = GatewaySettings(
        admin_token="unit-test-admin-token-0123456789", internal_token=TOKEN, metrics_public=metrics_public
    )
    return TestClient(create_app(settings))


@pytest.mark.parametrize("authorization", [None, "Bearer axk_a-client-key", f"Bearer {TOKEN}x"])
def test_metrics_refuse_a_scrape_without_the_internal_token(authorization: str | None) -> None:
    headers = {"authorization": authorization} if authorization else {}
    answer = _client(metrics_public=False).get("/metrics", headers=headers)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_internal_token"
    assert "axon_" not in answer.text


def test_metrics_answer_the_internal_token_or_anyone_when_public() -> None:
    answer = _client(metrics_public=False).get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200 and "axon_http_requests_total" in answer.text
    assert _client(metrics_public=True).get("/metrics").status_code == 200
