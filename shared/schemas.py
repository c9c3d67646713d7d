"""Wire schemas that cross a service boundary: the job and the token chunk (docs/architecture.md).

Plain pydantic only: no torch, vllm or fastapi import, so every service can use them.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "cancelled", "error"]
Role = Literal["system", "user", "assistant", "tool", "developer"]


class Message(BaseModel):
    """One chat message with its content flattened to text."""

    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str


class Sampling(BaseModel):
    """Sampling parameters a worker's engine honours for one job."""

    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None


class Job(BaseModel):
    """A generation request on its way from the session manager to a worker (RabbitMQ body)."""

    job_id: str
    model: str
    messages: list[Message] | None = None
    prompt: str | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    channel: str
    deadline: float = Field(description="Unix time (seconds) after which the job is worthless")
    session_id: str | None = None
    tenant: str = "anonymous"


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ChunkError(BaseModel):
    message: str
    type: str = "server_error"


class TokenChunk(BaseModel):
    """A piece of a job's answer, published by the worker on the job's channel.

    `seq` starts at 0 and grows by one per chunk; a receiver drops a `seq` it has
    already seen, which makes redelivery and failover safe.
    """

    seq: int = Field(ge=0)
    text: str = ""
    n_tokens: int = Field(0, ge=0)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: ChunkError | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None
