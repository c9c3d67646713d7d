"""The API's documentation page, served offline: `/docs` (Swagger UI).

FastAPI's own page loads Swagger UI from a CDN, so it is blank on a machine that cannot reach it.
This is FastAPI's page pointed at a copy the gateway serves itself under `/docs/static/`: the
files the `fastapi-offline` package ships (Swagger UI 5). Its Content-Security-Policy lets the
browser load nothing from anywhere else, so an asset that still pointed off-host would fail in
every test rather than work only online. ReDoc is not served: its bundle shows a logo from a CDN.
"""

import base64
import hashlib
import re
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response

from shared.errors import NotFound

ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"
ASSETS_PATH = "/docs/static"
ASSET_TYPES = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}
# Swagger UI's own default would show a badge image from the public validator.swagger.io.
SWAGGER_UI_PARAMETERS = {
    "dom_id": "#swagger-ui",
    "layout": "BaseLayout",
    "deepLinking": True,
    "showExtensions": True,
    "showCommonExtensions": True,
    "validatorUrl": None,
}
_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    # Revalidate on every load: a new gateway release never shows an old Swagger UI.
    "cache-control": "no-cache",
}
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)

router = APIRouter(include_in_schema=False)


def content_security_policy(page: str) -> str:
    """Only the gateway's own scripts, plus the page's inline ones by hash; inline styles too
    (Swagger UI sets some from script); the API calls of "Try it out" to the gateway alone."""
    hashes = [
        f"'sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}'"
        for script in _INLINE_SCRIPT.findall(page)
    ]
    return "; ".join(
        [
            "default-src 'none'",
            " ".join(["script-src 'self'", *hashes]),
            "style-src 'self' 'unsafe-inline'",
            "img-src 'self' data:",
            "font-src 'self' data:",
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


def _with_headers(html: HTMLResponse) -> HTMLResponse:
    page = bytes(html.body).decode()
    headers = {**_HEADERS, "content-security-policy": content_security_policy(page)}
    return HTMLResponse(page, headers=headers)


def _root(request: Request) -> str:
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI on the OpenAPI document."""
    root = _root(request)
    return _with_headers(
        get_swagger_ui_html(
            openapi_url=f"{root}{request.app.openapi_url}",
            title=f"{request.app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_PATH}/favicon.png",
            swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
        )
    )


@router.get(ASSETS_PATH + "/{name}")
async def asset(name: str) -> Response:
    """A script, style or icon of the documentation page."""
    media_type = ASSET_TYPES.get(name)
    if media_type is None:
        raise NotFound("No such documentation file.")
    return FileResponse(ASSETS_DIR / name, media_type=media_type, headers=_HEADERS)
