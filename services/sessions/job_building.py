"""A request as jobs: one per choice (`n`), each with its model (or LoRA adapter), its input, its
sampling, the features it asks for and the channel it is answered on.

The first choice's job is built from the request; choice i's is a copy answered on its own
channel, with seed + i when the request has a seed (`for_choice`).
"""

import time
from typing import Any

from services.sessions.relay import TokenStream
from services.sessions.settings import SessionsSettings
from services.sessions.turns import Turn
from shared.errors import InvalidRequest
from shared.internal_headers import Caller
from shared.openai_requests import ChatCompletionRequest, CompletionRequest
from shared.registry import LiveModel
from shared.schema_bounds import check_answer_fits
from shared.schemas import Job, Message, Sampling

# Seeds are 64-bit: choice i's (seed + i) wraps around within them.
_SEED_SPAN = 2**64


class JobBuilder:
    """Builds a request's jobs within the session manager's limits (`SessionsSettings`)."""

    def __init__(self, settings: SessionsSettings) -> None:
        self._settings = settings

    def sampling(self, body: ChatCompletionRequest | CompletionRequest, live: LiveModel) -> Sampling:
        """The request's sampling, with its `max_tokens` (or the default) checked against the model,
        and against the shortest answer its schema admits (`shared/schema_bounds.py`).

        Raises:
            InvalidRequest: `max_tokens` larger than the model's context (`context_length_exceeded`,
                naming the messages or prompt, as OpenAI does) or than `AXON_MAX_TOKENS_LIMIT`
                (naming `max_tokens`, code null, as OpenAI's "max_tokens is too large"), or too few
                for any answer the `response_format` (or a required or named tool call's) schema admits.
        """
        max_tokens = body.requested_max_tokens or min(self._settings.default_max_tokens, live.context_tokens // 2)
        if max_tokens > live.context_tokens:
            chat = isinstance(body, ChatCompletionRequest)
            raise InvalidRequest(
                f"This model's maximum context length is {live.context_tokens} tokens. However, you requested "
                f"{max_tokens} tokens for the completion alone. Please reduce the length of the completion.",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens > self._settings.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens is too large: {max_tokens}. This model supports at most "
                f"{self._settings.max_tokens_limit} completion tokens, whereas you provided {max_tokens}.",
                param="max_tokens",
            )
        check_answer_fits(body, max_tokens)
        return body.sampling(max_tokens)

    def input(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[list[Message] | None, str | None]:
        """The request's messages (a chat, checked) or its prompt (a completion).

        Raises:
            InvalidRequest: more messages than `AXON_MAX_MESSAGES`.
        """
        if isinstance(body, ChatCompletionRequest):
            messages = [m.to_message() for m in body.messages]
            if len(messages) > self._settings.max_messages:
                raise InvalidRequest(
                    f"{len(messages)} messages is more than the {self._settings.max_messages} allowed.",
                    param="messages",
                )
            return messages, None
        return None, body.prompt_text

    def job(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        model: str,
        adapter: str | None,
        *,
        messages: list[Message] | None,
        prompt: str | None,
        sampling: Sampling,
        stream: TokenStream,
        turn: Turn | None,
        caller: Caller,
    ) -> Job:
        """The job of the request's first choice for `model`'s queue (naming `adapter`, a LoRA
        adapter of it, if set), answered on `stream`'s channel."""
        features: dict[str, Any] = {}
        if isinstance(body, ChatCompletionRequest):
            if body.tools is not None:  # tool_choice `none`: no tools
                features.update(
                    tools=body.tool_specs(), tool_choice=body.job_tool_choice(), parallel_tool_calls=body.parallel_calls
                )
            if body.response_format is not None:
                features["response_format"] = body.job_response_format()
        elif body.echo:
            features["echo"] = True
        return Job(
            job_id=stream.job_id,
            model=model,
            adapter=adapter,
            messages=messages,
            prompt=prompt,
            sampling=sampling,
            channel=stream.channel,
            deadline=time.time() + self._settings.request_timeout_s,
            session_id=turn.info.id if turn else None,
            tenant=caller.tenant,
            key_id=caller.key_id,
            batch=caller.batch,
            logprobs=body.logprob_count,
            **features,
        )


def for_choice(job: Job, index: int, stream: TokenStream) -> Job:
    """Choice `index`'s job: the first choice's `job` answered on `stream`, with seed + `index`
    when it has a seed."""
    sampling = job.sampling
    if sampling.seed is not None:
        seed = (sampling.seed + index + _SEED_SPAN // 2) % _SEED_SPAN - _SEED_SPAN // 2
        sampling = sampling.model_copy(update={"seed": seed})
    return job.model_copy(update={"job_id": stream.job_id, "channel": stream.channel, "sampling": sampling})
