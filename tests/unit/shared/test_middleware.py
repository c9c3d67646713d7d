"""shared.middleware: a request id on every response, the caller's when it can be trusted."""

import re

import httpx
import pytest
import structlog

from shared.middleware import REQUEST_ID_HEADER


async def test_request_id_is_echoed(app_client: httpx.AsyncClient) -> None:
    response = await app_client.get("/ok", headers={REQUEST_ID_HEADER: "req-abc.123"})
    assert response.headers[REQUEST_ID_HEADER] == "req-abc.123"
    assert response.json() == {"request_id": "req-abc.123"}


async def test_request_id_is_generated_when_absent(app_client: httpx.AsyncClient) -> None:
    first = await app_client.get("/ok")
    second = await app_client.get("/ok")
    generated = first.headers[REQUEST_ID_HEADER]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    assert first.json() == {"request_id": generated}
    assert second.headers[REQUEST_ID_HEADER] != generated


async def test_error_responses_carry_the_request_id(app_client: httpx.AsyncClient) -> None:
    for path in ("/invalid", "/v1/nope"):
        response = await app_client.get(path, headers={REQUEST_ID_HEADER: "trace-1"})
        assert response.headers[REQUEST_ID_HEADER] == "trace-1", path


@pytest.mark.parametrize(
    "incoming",
    [
        "x" * 129,  # longer than the 128 allowed
        "bad\x01id",  # control character
        "   ",  # blank after stripping
    ],
)
async def test_untrusted_request_id_is_replaced(app_client: httpx.AsyncClient, incoming: str) -> None:
    response = await app_client.get("/ok", headers={REQUEST_ID_HEADER: incoming})
    returned = response.headers[REQUEST_ID_HEADER]
    assert returned != incoming.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", returned)


async def test_request_id_at_the_length_limit_is_kept(app_client: httpx.AsyncClient) -> None:
    incoming = "r" * 128
    response = await app_client.get("/ok", headers={REQUEST_ID_HEADER: incoming})
    assert response.headers[REQUEST_ID_HEADER] == incoming


async def test_internal_error_response_carries_the_request_id(app_client: httpx.AsyncClient) -> None:
    with structlog.testing.capture_logs():
        response = await app_client.get("/boom", headers={REQUEST_ID_HEADER: "trace-500"})
    assert response.status_code == 500
    assert response.headers.get(REQUEST_ID_HEADER) == "trace-500"


async def test_non_ascii_request_id_is_echoed_unchanged_or_replaced(app_client: httpx.AsyncClient) -> None:
    sent = "caf\u00e9".encode()
    response = await app_client.get("/ok", headers={REQUEST_ID_HEADER: sent})
    returned = dict(response.headers.raw)[REQUEST_ID_HEADER.encode()]
    assert returned == sent or re.fullmatch(rb"[0-9a-f]{32}", returned)
