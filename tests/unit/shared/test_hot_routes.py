"""shared.hot_routes: plain ASGI handlers answered ahead of FastAPI, with the same request context."""

import httpx

from shared.middleware import REQUEST_ID_HEADER


async def test_hot_routes_answer_with_a_request_id_and_everything_else_reaches_fastapi(
    app_client: httpx.AsyncClient,
) -> None:
    response = await app_client.post("/hot/echo", content=b"hi")
    assert response.status_code == 200 and response.json() == {"echo": "hi"}
    assert response.headers["x-hot"] == "1" and response.headers[REQUEST_ID_HEADER]
    assert (await app_client.get("/hot/echo")).status_code == 404  # another method: not a hot route
    assert (await app_client.get("/ok")).status_code == 200


async def test_a_hot_route_refuses_a_body_past_its_limit(app_client: httpx.AsyncClient) -> None:
    response = await app_client.post("/hot/echo", content=b"x" * 17)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
