"""JSON rendered with orjson, and the end of a server-sent event stream."""

from typing import Any

import orjson
from fastapi.responses import JSONResponse


class ORJSONResponse(JSONResponse):
    """JSON response rendered with orjson (faster, and handles non-str keys)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


SSE_END = b"data: [DONE]\n\n"
