"""Settings every service shares. Each service subclasses `CommonSettings` with its own fields."""

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


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
    # Connect/command timeout for Redis and the broker; every wait has a deadline.
    connect_timeout_s: float = Field(5.0, gt=0)
