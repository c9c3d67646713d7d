"""shared.http_errors: OpenAI-shaped errors for every failure, from FastAPI routes and hot routes alike."""

import httpx
import pytest
import structlog

ERROR_KEYS = {"message", "type", "param", "code"}


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"]
    assert set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


async def test_axon_error_maps_to_its_status_and_shape(app_client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await app_client.get("/invalid"), 400)
    assert error == {
        "message": "stop must be a string",
        "type": "invalid_request_error",
        "param": "stop",
        "code": None,
    }


async def test_axon_error_headers_reach_the_response(app_client: httpx.AsyncClient) -> None:
    response = await app_client.get("/busy")
    error = assert_openai_error(response, 503)
    assert error["code"] == "no_worker"
    assert response.headers["retry-after"] == "3"


async def test_body_validation_error_is_400_with_param(app_client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await app_client.post("/echo", json={"model": "m", "temperature": "hot"}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "temperature"
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("temperature:")


async def test_a_number_past_its_bound_is_refused_with_openais_code_and_message(app_client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await app_client.post("/echo", json={"model": "m", "temperature": 5}), 400)
    assert error == {
        "message": "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 5 instead.",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": "decimal_above_max_value",
    }


async def test_missing_field_names_the_field(app_client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await app_client.post("/echo", json={}), 400)
    assert error["param"] == "model"


async def test_malformed_json_is_400_not_500(app_client: httpx.AsyncClient) -> None:
    response = await app_client.post("/echo", content=b"{not json", headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None


async def test_valid_body_passes(app_client: httpx.AsyncClient) -> None:
    response = await app_client.post("/echo", json={"model": "m"})
    assert response.status_code == 200
    assert response.json() == {"model": "m"}


async def test_unknown_route_is_404_openai_shape(app_client: httpx.AsyncClient) -> None:
    error = assert_openai_error(await app_client.post("/v1/embeddings"), 404)
    assert error == {
        "message": "Invalid URL (POST /v1/embeddings)",  # OpenAI's words
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


async def test_wrong_method_is_405_openai_shape(app_client: httpx.AsyncClient) -> None:
    response = await app_client.post("/ok")
    error = assert_openai_error(response, 405)
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "Method Not Allowed (POST /ok)"
    assert response.headers["allow"] == "GET"


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "OPTIONS"])
async def test_allow_lists_every_method_of_the_path(app_client: httpx.AsyncClient, method: str) -> None:
    """Not only the first route's (FastAPI has a route per method): Starlette's own said GET."""
    response = await app_client.request(method, "/items/a")
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "DELETE, GET"


async def test_unexpected_exception_is_500_openai_shape(app_client: httpx.AsyncClient) -> None:
    # capture_logs also skips rendering the traceback, which takes about a second.
    with structlog.testing.capture_logs() as logs:
        error = assert_openai_error(await app_client.get("/boom"), 500)
    assert error["type"] == "server_error"
    assert error["code"] == "internal_error"
    assert "secret" not in error["message"]
    assert any(entry["event"] == "unhandled_error" and "secret internal detail" in entry["error"] for entry in logs)


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [("/hot/refuses", 400, None), ("/hot/down", 503, None), ("/hot/crashes", 500, "internal_error")],
)
async def test_hot_route_errors_map_as_fastapis_do(
    app_client: httpx.AsyncClient, path: str, status: int, code: str | None
) -> None:
    error = assert_openai_error(await app_client.post(path, content=b"{}"), status)
    assert "secret" not in error["message"]
    if code:
        assert error["code"] == code
