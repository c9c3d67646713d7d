"""OpenAI wire models for chat and text completions (requests in, chunks and responses out)."""

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.errors import InvalidRequest
from shared.schemas import FinishReason, Message, Role


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_message(self, index: int) -> Message:
        if self.content is None:
            return Message(role=self.role, content="")
        if isinstance(self.content, str):
            return Message(role=self.role, content=self.content)
        if any(part.type != "text" for part in self.content):
            raise InvalidRequest("Only text content parts are supported.", param=f"messages.{index}.content")
        return Message(role=self.role, content="".join(part.text or "" for part in self.content))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    session_id: str | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return value

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


Kind = Literal["chat", "completion"]


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    """Axon's finish reasons as OpenAI's: a cancelled answer simply stopped."""
    return "stop" if reason == "cancelled" else reason


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder:
    """Builds the OpenAI objects for one request: chunks while streaming, or the whole response."""

    def __init__(self, *, kind: Kind, job_id: str, model: str) -> None:
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + job_id
        self.model = model
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(
        self, text: str, finish_reason: FinishReason | None, *, first: bool, usage_field: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk; with `usage_field` (include_usage), it carries `"usage": null` as OpenAI's do."""
        body = self._chunk(text, finish_reason, first=first)
        if usage_field:
            body["usage"] = None
        return body

    def _chunk(self, text: str, finish_reason: FinishReason | None, *, first: bool) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text and not first:
                delta = {}
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": openai_finish_reason(finish_reason),
            }
            return self._envelope([choice], "chat.completion.chunk")
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": openai_finish_reason(finish_reason)}
        return self._envelope([choice], "text_completion")

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope([], obj)
        body["usage"] = usage_dict(prompt_tokens, completion_tokens)
        return body

    def response(
        self, text: str, finish_reason: FinishReason, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": openai_finish_reason(finish_reason),
            }
            body = self._envelope([choice], "chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": openai_finish_reason(finish_reason)}
            body = self._envelope([choice], "text_completion")
        body["usage"] = usage_dict(prompt_tokens, completion_tokens)
        return body
