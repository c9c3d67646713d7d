"""Gateway settings (`AXON_*` environment variables)."""

import ssl
from typing import Any

from pydantic import Field, SecretStr, model_validator

from shared.settings import CommonSettings

# Admin tokens that must never protect a real deployment.
WELL_KNOWN_TOKENS = frozenset(
    {"admin", "changeme", "change-me", "secret", "password", "token", "test", "axon", "default", "dev"}
)
MIN_ADMIN_TOKEN_LEN = 16


class GatewaySettings(CommonSettings):
    host: str = "0.0.0.0"
    gateway_port: int = Field(8000, ge=1, le=65535)
    # The session manager: `AXON_SESSIONS_URL`, else http://127.0.0.1:`AXON_SESSIONS_PORT`.
    sessions_port: int = Field(8001, ge=1, le=65535)
    sessions_url: str = ""
    # Request bodies larger than this are refused with 413 before being read whole.
    max_body_bytes: int = Field(1024 * 1024, ge=1024)
    # The largest file `POST /v1/files` takes (the session manager's setting of the same name): an
    # upload streams through, its body at most this and FILE_FORM_OVERHEAD_BYTES more (else 413).
    file_max_bytes: int = Field(200 * 1024 * 1024, ge=1)
    # Limits of every client connection (shared/guarded_http.py): the whole request head must
    # arrive within this (else the connection is closed, with 408 if part came) ...
    request_head_timeout_s: float = Field(10.0, gt=0)
    # ... and be at most this large (else 431),
    max_header_bytes: int = Field(32 * 1024, ge=1024)
    # the whole body within this after its head (else 408),
    request_body_timeout_s: float = Field(30.0, gt=0)
    # a client that reads nothing for this long while its answer waits to be sent is disconnected,
    client_stall_timeout_s: float = Field(30.0, gt=0)
    # and the kernel buffers at most this much unsent answer per connection.
    client_send_buffer_bytes: int = Field(256 * 1024, ge=16 * 1024)
    # Waiting for the session manager's response headers (it waits for the first token).
    upstream_timeout_s: float = Field(330.0, gt=0)
    upstream_connect_timeout_s: float = Field(3.0, gt=0)
    # Requests this process forwards at once (streams included); one more is refused at once
    # with 503 `overloaded` and Retry-After, before any other work.
    max_requests_in_flight: int = Field(1000, ge=1)

    # Bearer token of the admin API (/admin/*). Required: the gateway refuses to start
    # without one, or with a short or well-known one.
    admin_token: SecretStr | None = None
    # How long a key lookup is reused in-process; revocation takes effect within this.
    key_cache_local_ttl_s: float = Field(0.5, ge=0, le=1)
    # How long a key lookup is cached in Redis (found, and not found).
    key_cache_ttl_s: int = Field(60, ge=1)
    # Redis down: admit requests without rate limiting (true) or refuse with 503 (false).
    rate_limit_fail_open: bool = False
    # A concurrency lease is dropped after this long even if its gateway died holding it.
    concurrency_lease_s: float = Field(360.0, gt=0)
    # The session manager's settings of the same names: a completion without max_tokens is charged
    # AXON_DEFAULT_MAX_TOKENS per choice against its key's tokens per minute and token budget at
    # admission, and none more than AXON_MAX_TOKENS_LIMIT per choice.
    default_max_tokens: int = Field(256, ge=1)
    max_tokens_limit: int = Field(8192, ge=1)
    # How long the aliases a key's model allowlist is checked with are reused in-process.
    models_cache_ttl_s: float = Field(1.0, ge=0)
    # Every gateway copies the tenants' weights from PostgreSQL into Redis at start and this often,
    # so a weight Redis missed or lost reaches the scheduler within this.
    tenant_weights_sync_s: float = Field(5.0, gt=0)
    # HTTPS without a load balancer: the gateway serves TLS itself with this certificate (PEM, the
    # chain after it) and its unencrypted private key (PEM). Both or neither; neither: plain HTTP.
    tls_certfile: str | None = None
    tls_keyfile: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _sessions_url_follows_port(cls, values: Any) -> Any:
        if isinstance(values, dict) and not values.get("sessions_url"):
            return {**values, "sessions_url": f"http://127.0.0.1:{values.get('sessions_port', 8001)}"}
        return values

    def admin_token_problem(self) -> str | None:
        """Why the admin token is unacceptable, or None."""
        token = self.admin_token.get_secret_value() if self.admin_token else ""
        if not token:
            return "AXON_ADMIN_TOKEN is not set"
        if token.lower() in WELL_KNOWN_TOKENS or len(token) < MIN_ADMIN_TOKEN_LEN:
            return f"AXON_ADMIN_TOKEN is well known or shorter than {MIN_ADMIN_TOKEN_LEN} characters"
        return None

    def tls_problem(self) -> str | None:
        """Why the gateway cannot serve HTTPS with the TLS files it was given, or None (also when
        it was given none)."""
        certfile, keyfile = self.tls_certfile or None, self.tls_keyfile or None
        if certfile is None and keyfile is None:
            return None
        if certfile is None or keyfile is None:
            unset = "AXON_TLS_CERTFILE" if certfile is None else "AXON_TLS_KEYFILE"
            return f"{unset} is not set; HTTPS needs both AXON_TLS_CERTFILE and AXON_TLS_KEYFILE"
        for variable, path in (("AXON_TLS_CERTFILE", certfile), ("AXON_TLS_KEYFILE", keyfile)):
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                return f"{variable} ({path}) cannot be read: {exc.strerror}"
        try:
            # An empty password: an encrypted key fails here rather than prompting on the terminal.
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=b"")
        except ssl.SSLError as exc:
            return (
                f"AXON_TLS_CERTFILE ({certfile}) and AXON_TLS_KEYFILE ({keyfile}) are not a PEM certificate "
                f"and its unencrypted private key: {exc.reason or exc}"
            )
        return None
