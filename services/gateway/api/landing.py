"""What a browser or `curl` finds at the gateway's root: `GET /` points to the playground, the API
reference and the API's base URL; `GET /favicon.ico` is an empty answer (a browser asks for it with
every page) rather than a 404 error in the console and the access log. Neither is part of the API,
so neither is in the OpenAPI document."""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

router = APIRouter(include_in_schema=False)

# A browser asks again at most once a day.
_FAVICON_HEADERS = {"cache-control": "public, max-age=86400"}


@router.get("/")
async def root(request: Request) -> dict[str, Any]:
    """Where to go from here."""
    base = str(request.base_url).rstrip("/")
    return {
        "name": request.app.title,
        "summary": request.app.summary,
        "api_base_url": f"{base}/v1",
        "playground": f"{base}/playground",
        "docs": f"{base}/docs",
        "openapi": f"{base}{request.app.openapi_url}",
        "authentication": "Every /v1 request needs an API key: Authorization: Bearer $AXON_API_KEY.",
    }


@router.get("/favicon.ico")
async def favicon() -> Response:
    """No icon: 204 instead of a 404."""
    return Response(status_code=204, headers=_FAVICON_HEADERS)
