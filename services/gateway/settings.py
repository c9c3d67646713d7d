"""Gateway settings (`AXON_*` environment variables)."""

from pydantic import Field

from shared.settings import CommonSettings


class GatewaySettings(CommonSettings):
    host: str = "0.0.0.0"
    gateway_port: int = Field(8000, ge=1, le=65535)
    sessions_url: str = "http://127.0.0.1:8001"
    # Request bodies larger than this are refused with 413 before being read whole.
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # Waiting for the session manager's response headers (it waits for the first token).
    upstream_timeout_s: float = Field(330.0, gt=0)
    upstream_connect_timeout_s: float = Field(3.0, gt=0)
    upstream_max_connections: int = Field(1000, ge=1)
