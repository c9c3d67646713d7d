"""Settings every service shares. Each service subclasses `CommonSettings` with its own fields."""

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
MIN_INTERNAL_TOKEN_LEN = 32


class InsecureConfiguration(RuntimeError):
    """A service refuses to start with this configuration (its main exits 2)."""


class CommonSettings(BaseSettings):
    """Connection and naming settings, from `AXON_*` environment variables."""

    model_config = SettingsConfigDict(env_prefix="AXON_", extra="ignore", frozen=True)

    namespace: str = Field("axon", pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    redis_url: str = "redis://127.0.0.1:6379/0"
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    database_url: str = "postgresql://postgres@127.0.0.1:5432/axon"
    log_level: str = "INFO"
    log_format: Literal["json", "console"] = "json"
    # Part of the job queue's declaration: every declarer must use the same value.
    max_queued_jobs: int = Field(1000, ge=1)
    # Limits given to API keys created without explicit ones (CLI and admin API).
    default_rpm: int = Field(600, ge=1)
    default_tpm: int = Field(200_000, ge=1)
    default_max_concurrent: int = Field(32, ge=1)
    # What a batch line's tokens are billed at, a share of them: the session manager charges
    # budgets so, the gateway's `/admin/usage` reports them so (`billed_tokens`).
    batch_billing_factor: float = Field(1.0, gt=0, le=1)
    # Connect/command timeout for Redis and the broker; every wait has a deadline.
    connect_timeout_s: float = Field(5.0, gt=0)
    # One stop request (SIGINT or SIGTERM): how long a worker's jobs in flight may still run
    # before they are handed back to the queue; the session manager and the gateway wait longer
    # (shared/serving.py:grace_s), so each hop's wait covers the one behind it.
    drain_timeout_s: float = Field(30.0, ge=0)
    # The credential of the internal hops (gateway -> session manager, Prometheus -> internal
    # services): only gateways hold it. Every service refuses to start without one.
    internal_token: SecretStr | None = None
    # Let the internal services' /metrics answer without the internal token (a private scrape network).
    metrics_public: bool = False
    # OpenTelemetry traces (shared/tracing.py): the OTLP/HTTP collector's base URL (spans go to
    # <url>/v1/traces); empty: tracing off, at no cost.
    otlp_endpoint: str = ""
    # The share of new traces kept (head sampling; a sampled caller's trace is always kept).
    trace_sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
    # Spans waiting for export, at most; past it they are dropped (and counted), never waited for.
    trace_max_queued_spans: int = Field(2048, ge=1)
    # How long one export to the collector may take (on the exporter's own thread).
    trace_export_timeout_s: float = Field(5.0, gt=0)

    def internal_token_problem(self) -> str | None:
        """Why the internal token is unacceptable, or None."""
        token = self.internal_token.get_secret_value() if self.internal_token else ""
        if not token:
            return "AXON_INTERNAL_TOKEN is not set"
        if len(token) < MIN_INTERNAL_TOKEN_LEN:
            return f"AXON_INTERNAL_TOKEN is shorter than {MIN_INTERNAL_TOKEN_LEN} characters"
        return None

    def require_internal_token(self) -> str:
        """The internal token.

        Raises:
            InsecureConfiguration: it is missing or too short.
        """
        problem = self.internal_token_problem()
        if problem is not None or self.internal_token is None:
            raise InsecureConfiguration(f"Refusing to start: {problem}.")
        return self.internal_token.get_secret_value()
