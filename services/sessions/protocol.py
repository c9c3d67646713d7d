"""OpenAI chunks and responses out, for chat and text completions (the requests they answer are
`shared/openai_requests.py`)."""

import time
from typing import Any

from shared.openai_requests import Kind
from shared.schemas import FinishReason


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
