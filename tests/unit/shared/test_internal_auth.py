"""The internal token's middleware and settings, at the ASGI boundary."""

import httpx
import pytest
from fastapi import FastAPI

from shared.internal_auth import InternalAuth, internal_headers
from shared.settings import MIN_INTERNAL_TOKEN_LEN, CommonSettings, InsecureConfiguration

TOKEN = "t" * MIN_INTERNAL_TOKEN_LEN


def _app(settings: CommonSettings) -> FastAPI:
    app = FastAPI()
    for path in ("/health", "/ready", "/metrics", "/v1/anything"):
        app.add_api_route(path, lambda: {"ok": True})
    app.add_middleware(InternalAuth, settings=settings)
    return app


async def _status(settings: CommonSettings, path: str, headers: dict[str, str]) -> int:
    transport = httpx.ASGITransport(app=_app(settings))
    async with httpx.AsyncClient(transport=transport, base_url="http://internal") as client:
        return (await client.get(path, headers=headers)).status_code


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"authorization": f"Bearer {TOKEN}x"}, 401),
        ({"authorization": f"Bearer {TOKEN[:-1]}"}, 401),
        ({"authorization": TOKEN}, 401),
        ({"authorization": f"bearer {TOKEN}"}, 401),
        (internal_headers(TOKEN), 200),
    ],
)
async def test_only_the_exact_bearer_token_passes(headers: dict[str, str], status: int) -> None:
    assert await _status(CommonSettings(internal_token=TOKEN), "/v1/anything", headers) == status


@pytest.mark.parametrize(("public", "metrics"), [(False, 401), (True, 200)])
async def test_probes_are_open_and_metrics_only_where_configured(public: bool, metrics: int) -> None:
    settings = CommonSettings(internal_token=TOKEN, metrics_public=public)
    assert await _status(settings, "/health", {}) == 200
    assert await _status(settings, "/ready", {}) == 200
    assert await _status(settings, "/metrics", {}) == metrics


@pytest.mark.parametrize("token", [None, "", "x" * (MIN_INTERNAL_TOKEN_LEN - 1)])
def test_a_missing_or_short_token_refuses_to_start(token: str | None) -> None:
    with pytest.raises(InsecureConfiguration, match="AXON_INTERNAL_TOKEN"):
        CommonSettings(internal_token=token).require_internal_token()
