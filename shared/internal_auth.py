"""The internal hops' credential. Only gateways face clients; the session manager and the workers
answer only requests that carry `Authorization: Bearer <AXON_INTERNAL_TOKEN>` (compared in constant
time), except the liveness and readiness probes and, where configured, `/metrics`."""

import hmac

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.settings import CommonSettings

# Orchestrators probe these without credentials; they reveal nothing about any tenant.
OPEN_PATHS = frozenset({"/health", "/ready"})

_REFUSAL = orjson.dumps(
    {
        "error": {
            "message": "This is an internal Axon service: it answers only its gateways, which send the internal "
            "token (Authorization: Bearer $AXON_INTERNAL_TOKEN). Clients call the gateway.",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_internal_token",
        }
    }
)


def internal_headers(token: str) -> dict[str, str]:
    """The header a caller of an internal service sends."""
    return {"authorization": f"Bearer {token}"}


class InternalAuth:
    """ASGI middleware refusing (401) any HTTP request without the internal token."""

    def __init__(self, app: ASGIApp, *, settings: CommonSettings) -> None:
        self._app = app
        self._expected = f"Bearer {settings.require_internal_token()}".encode("latin-1")
        self._open = OPEN_PATHS | ({"/metrics"} if settings.metrics_public else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open or self._authorized(scope):
            await self._app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(_REFUSAL)),
                    (b"www-authenticate", b'Bearer realm="axon-internal"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _REFUSAL})

    def _authorized(self, scope: Scope) -> bool:
        supplied = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                supplied = value
                break
        return hmac.compare_digest(supplied, self._expected)
