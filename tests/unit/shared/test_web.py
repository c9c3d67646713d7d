"""shared.web: OpenAI-shaped errors for every failure and a request id on every response."""

import re
from collections.abc import AsyncIterator

import httpx
import pytest
import structlog
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.errors import InvalidRequest, Unavailable
from shared.web import (
    REQUEST_ID_HEADER,
    HotRoute,
    HotRoutes,
    RequestContextMiddleware,
    install_error_handlers,
    read_body,
    send_json,
)

ERROR_KEYS = {"message", "type", "param", "code"}


class Body(BaseModel):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)


def build_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware)

    @app.get("/ok")
    async def ok(request: Request) -> dict[str, str]:
        return {"request_id": request.state.request_id}

    @app.post("/echo")
    async def echo(body: Body) -> dict[str, str]:
        return {"model": body.model}

    @app.get("/invalid")
    async def invalid() -> None:
        raise InvalidRequest("stop must be a string", param="stop")

    @app.get("/busy")
    async def busy() -> None:
        raise Unavailable("no worker", retry_after_s=3, code="no_worker")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internal detail")

    return app


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"]
    assert set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


async def test_axon_error_maps_to_its_status_and_shape(client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await client.get("/invalid"), 400)
    assert error == {
        "message": "stop must be a string",
        "type": "invalid_request_error",
        "param": "stop",
        "code": None,
    }


async def test_axon_error_headers_reach_the_response(client: httpx.AsyncClient) -> None:
    response = await client.get("/busy")
    error = assert_openai_error(response, 503)
    assert error["code"] == "no_worker"
    assert response.headers["retry-after"] == "3"


async def test_body_validation_error_is_400_with_param(client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await client.post("/echo", json={"model": "m", "temperature": 5}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "temperature"
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("temperature:")


async def test_missing_field_names_the_field(client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await client.post("/echo", json={}), 400)
    assert error["param"] == "model"


async def test_malformed_json_is_400_not_500(client: httpx.AsyncClient) -> None:
    response = await client.post("/echo", content=b"{not json", headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None


async def test_valid_body_passes(client: httpx.AsyncClient) -> None:
    response = await client.post("/echo", json={"model": "m"})
    assert response.status_code == 200
    assert response.json() == {"model": "m"}


async def test_unknown_route_is_404_openai_shape(client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await client.get("/v1/nope"), 404)
    assert error["type"] == "invalid_request_error"


async def test_wrong_method_is_405_openai_shape(client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await client.post("/ok"), 405)
    assert error["type"] == "invalid_request_error"


async def test_unexpected_exception_is_500_openai_shape(client: httpx.AsyncClient) -> None:
    # capture_logs also skips rendering the traceback, which takes about a second.
    with structlog.testing.capture_logs() as logs:
        error = assert_openai_error(await client.get("/boom"), 500)
    assert error["type"] == "server_error"
    assert error["code"] == "internal_error"
    assert "secret" not in error["message"]
    assert any(entry["event"] == "unhandled_error" and "secret internal detail" in entry["error"] for entry in logs)


async def test_request_id_is_echoed(client: httpx.AsyncClient) -> None:
    response = await client.get("/ok", headers={REQUEST_ID_HEADER: "req-abc.123"})
    assert response.headers[REQUEST_ID_HEADER] == "req-abc.123"
    assert response.json() == {"request_id": "req-abc.123"}


async def test_request_id_is_generated_when_absent(client: httpx.AsyncClient) -> None:
    first = await client.get("/ok")
    second = await client.get("/ok")
    generated = first.headers[REQUEST_ID_HEADER]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    assert first.json() == {"request_id": generated}
    assert second.headers[REQUEST_ID_HEADER] != generated


async def test_error_responses_carry_the_request_id(client: httpx.AsyncClient) -> None:
    for path in ("/invalid", "/v1/nope"):
        response = await client.get(path, headers={REQUEST_ID_HEADER: "trace-1"})
        assert response.headers[REQUEST_ID_HEADER] == "trace-1", path


@pytest.mark.parametrize(
    "incoming",
    [
        "x" * 129,  # longer than the 128 allowed
        "bad\x01id",  # control character
        "   ",  # blank after stripping
    ],
)
async def test_untrusted_request_id_is_replaced(client: httpx.AsyncClient, incoming: str) -> None:
    response = await client.get("/ok", headers={REQUEST_ID_HEADER: incoming})
    returned = response.headers[REQUEST_ID_HEADER]
    assert returned != incoming.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", returned)


async def test_request_id_at_the_length_limit_is_kept(client: httpx.AsyncClient) -> None:
    incoming = "r" * 128
    response = await client.get("/ok", headers={REQUEST_ID_HEADER: incoming})
    assert response.headers[REQUEST_ID_HEADER] == incoming


async def test_internal_error_response_carries_the_request_id(client: httpx.AsyncClient) -> None:
    with structlog.testing.capture_logs():
        response = await client.get("/boom", headers={REQUEST_ID_HEADER: "trace-500"})
    assert response.status_code == 500
    assert response.headers.get(REQUEST_ID_HEADER) == "trace-500"


async def test_non_ascii_request_id_is_echoed_unchanged_or_replaced(client: httpx.AsyncClient) -> None:
    sent = "caf\u00e9".encode()
    response = await client.get("/ok", headers={REQUEST_ID_HEADER: sent})
    returned = dict(response.headers.raw)[REQUEST_ID_HEADER.encode()]
    assert returned == sent or re.fullmatch(rb"[0-9a-f]{32}", returned)


def build_hot_app() -> FastAPI:
    """A FastAPI app with hot routes in front, as the gateway and the session manager install them."""

    async def echo(scope, receive, send) -> None:
        body = await read_body(scope, receive, max_bytes=16)
        await send_json(send, 200, b'{"echo": "%s"}' % body, [(b"x-hot", b"1")])

    async def refuses(scope, receive, send) -> None:
        raise InvalidRequest("nope", param="model")

    async def storage_down(scope, receive, send) -> None:
        raise RedisConnectionError("gone")

    async def crashes(scope, receive, send) -> None:
        raise RuntimeError("secret internal detail")

    app = build_app()
    hot = [
        HotRoute("POST", "/hot/echo", echo),
        HotRoute("POST", "/hot/refuses", refuses),
        HotRoute("POST", "/hot/down", storage_down),
        HotRoute("POST", "/hot/crashes", crashes),
    ]
    app.add_middleware(HotRoutes, routes=hot)
    app.add_middleware(RequestContextMiddleware)
    return app


@pytest.fixture
async def hot_client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_hot_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def test_hot_routes_answer_with_a_request_id_and_everything_else_reaches_fastapi(hot_client) -> None:
    response = await hot_client.post("/hot/echo", content=b"hi")
    assert response.status_code == 200 and response.json() == {"echo": "hi"}
    assert response.headers["x-hot"] == "1" and response.headers[REQUEST_ID_HEADER]
    assert (await hot_client.get("/hot/echo")).status_code == 404  # another method: not a hot route
    assert (await hot_client.get("/ok")).status_code == 200


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [("/hot/refuses", 400, None), ("/hot/down", 503, None), ("/hot/crashes", 500, "internal_error")],
)
async def test_hot_route_errors_map_as_fastapis_do(hot_client, path: str, status: int, code: str | None) -> None:
    error = assert_openai_error(await hot_client.post(path, content=b"{}"), status)
    assert "secret" not in error["message"]
    if code:
        assert error["code"] == code


async def test_a_hot_route_refuses_a_body_past_its_limit(hot_client) -> None:
    error = assert_openai_error(await hot_client.post("/hot/echo", content=b"x" * 17), 413)
    assert error["code"] == "request_too_large"
