"""The playground: a chat page served as static files at `/playground`.

The page talks to the public API from the browser, with the key the user types in; it needs no
key to load and no server state. Only files that exist in `static/playground` when the app is
built, with a known type, are served, so no request path ever reaches the file system.
"""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from shared.errors import NotFound

STATIC_DIR = Path(__file__).parent / "static" / "playground"

_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}

# Scripts and styles only from the gateway itself, no inline code: whatever a model writes is
# sanitised Markdown, and even if markup slipped through it could not run or call elsewhere.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
    # Revalidate on every load: a new gateway release never runs with an old script.
    "cache-control": "no-cache",
}


def _served_files(root: Path) -> dict[str, Path]:
    """Every file under `root` with a known type, by its path relative to `root`."""
    return {
        path.relative_to(root).as_posix(): path
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.suffix in _MEDIA_TYPES
    }


def _file_response(path: Path) -> Response:
    return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix], headers=SECURITY_HEADERS)


def create_router(root: Path = STATIC_DIR) -> APIRouter:
    """Routes for the page (`/playground`) and its assets (`/playground/static/...`)."""
    files = _served_files(root)
    router = APIRouter(include_in_schema=False)

    @router.get("/playground")
    async def page() -> Response:
        """The playground page."""
        return _file_response(files["index.html"])

    @router.get("/playground/static/{name:path}")
    async def asset(name: str) -> Response:
        """A script or style of the page."""
        path = files.get(name)
        if path is None:
            raise NotFound("No such playground file.")
        return _file_response(path)

    return router
