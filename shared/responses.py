"""Responses the services build through FastAPI: JSON rendered with orjson, and server-sent events."""

from collections.abc import AsyncIterable, Mapping
from typing import Any

import orjson
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Send


class ORJSONResponse(JSONResponse):
    """JSON response rendered with orjson (faster, and handles non-str keys)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


SSE_END = b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A stream of server-sent events that ends with `data: [DONE]`.

    The piece that carries `[DONE]` also ends the HTTP body, so the chunked-encoding terminator
    goes out in the same write instead of one more (a socket write per message is the dearest
    thing a stream does). Anything the iterator yields after the end is dropped.
    """

    media_type = "text/event-stream"
    body_iterator: AsyncIterable[bytes]

    def __init__(
        self,
        content: AsyncIterable[bytes],
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
        background: BackgroundTask | None = None,
    ) -> None:
        super().__init__(content, status_code, headers, media_type, background)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for piece in self.body_iterator:
            if ended:
                continue
            ended = piece.endswith(SSE_END)
            await send({"type": "http.response.body", "body": piece, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
