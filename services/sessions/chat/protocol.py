"""OpenAI's response objects for chat and text completions: streamed chunks and whole answers.

Every body validates against OpenAI's published schemas (`openai/openai-openapi`,
`CreateChatCompletionResponse`, `CreateChatCompletionStreamResponse`, `CreateCompletionResponse`;
tests/contract). A request that did not ask for a feature (logprobs, echo, tools) costs no work for
it: each is looked at only when the request or the chunk carries it.

Every streamed event has an SSE `id:` (an Axon extension; OpenAI's chat streams have none). With
one choice it is the chunk's `seq`, and the usage event's is the final chunk's `seq` + 1: a client
that reconnects sends the last one it received as `Last-Event-ID` to
`GET /v1/chat/completions/{id}/stream` and gets the events after it (`chat/resume.py`). With `n`
choices an event's id is `<seq>.<choice index>` and the usage event's `usage`: they name the event
(such streams are not resumable: only a session turn's are, which has one choice).
"""

import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from shared.schemas import (
    FinishReason,
    FunctionCall,
    PromptTokensDetails,
    TokenChunk,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)

Kind = Literal["chat", "completion"]


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    """Axon's finish reasons as OpenAI's: a cancelled answer simply stopped."""
    return "stop" if reason == "cancelled" else reason


def has_event(chunk: TokenChunk, first: bool) -> bool:
    """Whether a chunk is streamed as an event: anything but a later chunk with nothing to say
    (no text, no tool call, not the end). `first`: its choice's first chunk, which opens it."""
    return bool(chunk.text or chunk.finish_reason is not None or first or chunk.tool_calls)


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's `usage` object (`prompt_tokens_details.cached_tokens` when the engine reported it)."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.prompt_tokens_details is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.prompt_tokens_details.cached_tokens}
    return body


def request_usage(usages: Iterable[Usage | None]) -> Usage | None:
    """The usage a response reports for choices that ran as separate jobs, as OpenAI counts it for
    `n`: the prompt once (every job had the same), the completions summed. Cached prompt tokens are
    the fewest any choice had (cached for every one of them). None if no choice reported usage."""
    known = [u for u in usages if u is not None]
    if len(known) <= 1:
        return known[0] if known else None
    details = [u.prompt_tokens_details for u in known if u.prompt_tokens_details is not None]
    return Usage(
        prompt_tokens=max(u.prompt_tokens for u in known),
        completion_tokens=sum(u.completion_tokens for u in known),
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(d.cached_tokens for d in details))
        if details
        else None,
    )


def work_usage(usages: Iterable[Usage | None]) -> Usage | None:
    """What choices that ran as separate jobs cost the platform: every job's prompt and completion
    tokens (the request's rate-limit charge and usage record, as the gateway estimated it)."""
    known = [u for u in usages if u is not None]
    if len(known) <= 1:
        return known[0] if known else None
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in known),
        completion_tokens=sum(u.completion_tokens for u in known),
    )


class _CallParts:
    """A tool call being assembled from its deltas."""

    __slots__ = ("arguments", "id", "name")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name = ""
        self.arguments: list[str] = []


class Answer:
    """One choice's answer as its chunks arrive: text, tool calls merged from their deltas (by
    `index`: the first delta names the call, the others add pieces of its arguments), logprobs."""

    __slots__ = ("_calls", "finish_reason", "index", "logprobs", "text", "usage")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: FinishReason | None = None
        self.usage: Usage | None = None
        self._calls: dict[int, _CallParts] | None = None

    def add_tool_calls(self, deltas: Sequence[ToolCallDelta]) -> None:
        calls = self._calls if self._calls is not None else {}
        self._calls = calls
        for delta in deltas:
            parts = calls.get(delta.index)
            if parts is None:
                parts = calls[delta.index] = _CallParts()
            if delta.id is not None:
                parts.id = delta.id
            if delta.function is not None:
                if delta.function.name:
                    parts.name += delta.function.name
                if delta.function.arguments:
                    parts.arguments.append(delta.function.arguments)

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def tool_calls(self) -> list[ToolCall] | None:
        """The complete calls, in index order; None when the answer made none."""
        if not self._calls:
            return None
        return [
            ToolCall(
                # Workers always send an id; one is made rather than answer without it.
                id=parts.id or f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(name=parts.name, arguments="".join(parts.arguments)),
            )
            for _, parts in sorted(self._calls.items())
        ]


def _tool_call_deltas(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """Tool-call deltas in OpenAI's streaming shape: a call's first delta carries `id`, `type` and
    `function.name` with `arguments: ""`, later ones `function.arguments` pieces."""
    out = []
    for delta in deltas:
        body = delta.model_dump(exclude_none=True)
        if "id" in body:
            body["type"] = "function"
        function = body.get("function")
        if function is not None and "name" in function:
            function.setdefault("arguments", "")
        out.append(body)
    return out


def _chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object: the tokens' (each with its `top_logprobs`, `[]` for none)."""
    return {"content": [lp.model_dump() for lp in logprobs], "refusal": None}


def _legacy_logprobs(logprobs: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """The completions API's `logprobs` object for tokens starting at `offset` in the choice's text:
    `top_logprobs` maps the k most likely tokens and the sampled one to their logprob."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    for lp in logprobs:
        tokens.append(lp.token)
        token_logprobs.append(lp.logprob)
        top = {t.token: t.logprob for t in lp.top_logprobs}
        top.setdefault(lp.token, lp.logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


class ResponseBuilder:
    """Builds the OpenAI objects for one request: chunks while streaming, or the whole response.

    `logprobs`: the request asked for them (a completion with `echo` gets the prompt's first: the
    worker puts the prompt and its logprobs in each choice's first chunk); `include_usage`: a usage
    chunk ends the stream. The
    other chunks leave `usage` out: OpenAI's document describes it as null there but types it as a
    non-nullable object, which clients generated from the document would refuse.
    """

    def __init__(
        self,
        *,
        kind: Kind,
        job_id: str,
        model: str,
        include_usage: bool = False,
        logprobs: bool = False,
        created: int | None = None,
    ) -> None:
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + job_id
        self.model = model
        # Unix time (s) of the response: now, or a resumed stream's original one.
        self.created = int(time.time()) if created is None else created
        self.include_usage = include_usage
        self.logprobs = logprobs
        # Completions with logprobs: per choice, where the next token starts in its text.
        self._offsets: dict[int, int] = {}

    def _envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, index: int, chunk: TokenChunk, *, first: bool) -> dict[str, Any]:
        """The streamed chunk of choice `index` for `chunk`; `first`: its choice's first chunk."""
        if self.kind == "chat":
            return self._envelope([self._chat_choice(index, chunk, first)], "chat.completion.chunk")
        return self._envelope([self._text_choice(index, chunk)], "text_completion")

    def _chat_choice(self, index: int, chunk: TokenChunk, first: bool) -> dict[str, Any]:
        text, calls = chunk.text, chunk.tool_calls
        delta: dict[str, Any]
        if first:
            # The role opens every choice; a choice that starts with a tool call has no content.
            delta = {"role": "assistant", "content": text if text or not calls else None}
        else:
            delta = {"content": text} if text or (chunk.finish_reason is None and not calls) else {}
        if calls:
            delta["tool_calls"] = _tool_call_deltas(calls)
        logprobs = _chat_logprobs(chunk.logprobs) if self.logprobs and chunk.logprobs else None
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": openai_finish_reason(chunk.finish_reason),
        }

    def _text_choice(self, index: int, chunk: TokenChunk) -> dict[str, Any]:
        text = chunk.text
        logprobs = None
        if self.logprobs:
            offset = self._offsets.get(index, 0)
            logprobs = _legacy_logprobs(chunk.logprobs or (), offset)
            self._offsets[index] = offset + len(text)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": openai_finish_reason(chunk.finish_reason),
        }

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The stream's last chunk with `include_usage`: no choices, the request's usage."""
        body = self._envelope([], "chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["usage"] = usage_dict(usage)
        return body

    def response(self, answers: Sequence[Answer], usage: Usage | None) -> dict[str, Any]:
        """The whole (non-streamed) response: one choice per answer, in index order."""
        ordered = sorted(answers, key=lambda a: a.index)
        if self.kind == "chat":
            body = self._envelope([self._chat_answer(a) for a in ordered], "chat.completion")
        else:
            body = self._envelope([self._text_answer(a) for a in ordered], "text_completion")
        body["usage"] = usage_dict(usage or Usage())
        return body

    def _chat_answer(self, answer: Answer) -> dict[str, Any]:
        content = answer.content
        calls = answer.tool_calls
        message: dict[str, Any] = {
            "role": "assistant",
            # An answer that is only tool calls has no content, as OpenAI's.
            "content": content if content or calls is None else None,
            "refusal": None,
        }
        if calls is not None:
            message["tool_calls"] = [call.model_dump() for call in calls]
        return {
            "index": answer.index,
            "message": message,
            "logprobs": _chat_logprobs(answer.logprobs) if self.logprobs else None,
            "finish_reason": openai_finish_reason(answer.finish_reason or "stop"),
        }

    def _text_answer(self, answer: Answer) -> dict[str, Any]:
        return {
            "index": answer.index,
            "text": answer.content,
            "logprobs": _legacy_logprobs(answer.logprobs, 0) if self.logprobs else None,
            "finish_reason": openai_finish_reason(answer.finish_reason or "stop"),
        }
