"""The app the HTTP tests drive: FastAPI routes and hot routes behind the project's error handlers
and request context, installed as the gateway and the session manager install them."""

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, Field
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.errors import InvalidRequest, Unavailable
from shared.hot_routes import HotRoute, HotRoutes, read_body, send_json
from shared.http_errors import install_error_handlers
from shared.middleware import RequestContextMiddleware


class Body(BaseModel):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)


def build_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

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

    # A path with a route per method, on an included router (as the gateway's public routes are).
    items = APIRouter()

    @items.get("/items/{item_id}")
    async def get_item(item_id: str) -> dict[str, str]:
        return {"id": item_id}

    @items.delete("/items/{item_id}")
    async def delete_item(item_id: str) -> dict[str, str]:
        return {"id": item_id}

    app.include_router(items)
    app.add_middleware(HotRoutes, routes=hot_routes())  # inside the request context below
    app.add_middleware(RequestContextMiddleware)
    return app


def hot_routes() -> list[HotRoute]:
    async def echo(scope, receive, send) -> None:
        body = await read_body(scope, receive, max_bytes=16)
        await send_json(send, 200, b'{"echo": "%s"}' % body, [(b"x-hot", b"1")])

    async def refuses(scope, receive, send) -> None:
        raise InvalidRequest("nope", param="model")

    async def storage_down(scope, receive, send) -> None:
        raise RedisConnectionError("gone")

    async def crashes(scope, receive, send) -> None:
        raise RuntimeError("secret internal detail")

    return [
        HotRoute("POST", "/hot/echo", echo),
        HotRoute("POST", "/hot/refuses", refuses),
        HotRoute("POST", "/hot/down", storage_down),
        HotRoute("POST", "/hot/crashes", crashes),
    ]


@pytest.fixture
async def app_client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http
