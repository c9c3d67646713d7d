"""The one small interface every inference engine implements."""

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from prometheus_client.metrics_core import Metric

from services.worker.engines.kv_events import KvEventSource, RenderedPrompt
from shared.schemas import (
    Capability,
    FinishReason,
    FunctionSpec,
    Job,
    Message,
    Sampling,
    TokenLogprob,
    ToolCallDelta,
)


class EngineError(Exception):
    """The engine failed a request (a server fault); the message is safe to show the client."""


class InvalidPrompt(EngineError):
    """The request cannot be served as asked (e.g. the prompt does not fit the context): a 400 for
    its client, naming the request parameter at fault (`param`) and OpenAI's `code` where known."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def context_exceeded(prompt_tokens: int, context_tokens: int, *, chat: bool) -> InvalidPrompt:
    """A prompt that leaves no room for an answer in the model's context, as OpenAI refuses it:
    `context_length_exceeded`, naming `messages` (a chat) or `prompt`."""
    return InvalidPrompt(
        f"This model's maximum context length is {context_tokens} tokens; the "
        f"{'messages' if chat else 'prompt'} take {prompt_tokens} tokens, leaving no room for an answer.",
        param="messages" if chat else "prompt",
        code="context_length_exceeded",
    )


class EngineStopped(Exception):
    """The engine was stopped under the request (the worker is shutting down): neither the
    request's fault nor an engine failure, so the job goes back to the queue to be resumed."""


class EngineDied(EngineStopped):
    """The engine died under the request (vLLM's engine core process was lost): the answer goes
    back to the queue for another worker to resume, and this worker exits."""


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a job stopped on a worker that died: the answer continues from here."""

    text: str
    token_ids: tuple[int, ...]
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Guide:
    """A constraint on the answer's text, enforced by constrained decoding.

    `json_schema`: the answer is one JSON value valid against `schema` (a JSON Schema, as text);
    `json_object`: any JSON object. `param`: the request parameter it comes from (named in the
    error when an engine refuses it).
    """

    kind: Literal["json_schema", "json_object"]
    schema: str | None = None
    param: Literal["response_format", "tools"] = "response_format"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What an engine needs to generate one answer (or the rest of one, with `resume`).

    With `resume`, `sampling.max_tokens` is the remaining budget and outputs count only
    the new tokens; a `guide` then continues from the state the resumed text left it in.
    """

    request_id: str
    sampling: Sampling
    messages: list[Message] | None = None
    prompt: str | None = None
    resume: Resume | None = None
    # Functions the prompt offers the model (rendered by the engine's chat template or its own).
    tools: list[FunctionSpec] | None = None
    guide: Guide | None = None
    # None: no logprobs; k: the sampled token's and the k most likely alternatives, per token.
    logprobs: int | None = None
    # Completions with `echo` and `logprobs`: the first output also carries the prompt's logprobs.
    echo: bool = False
    # One of the engine's `adapters` (a LoRA adapter's name) the answer comes from; None: the base model.
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """New text since the previous output of the same request.

    `completion_tokens` and `prompt_tokens` are running totals; `finish_reason` is set
    on the last output only.
    """

    text: str
    n_tokens: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    # The new tokens' ids, from engines that expose them (resumption is then exact).
    token_ids: tuple[int, ...] = ()
    # With `logprobs` requested: one entry per new token (of `text`).
    logprobs: tuple[TokenLogprob, ...] = ()
    # With `echo` and `logprobs`: the prompt's tokens, on the first output only.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # Prompt tokens served from the engine's prefix cache (a running figure, like `prompt_tokens`).
    cached_tokens: int = 0
    # The last output of an answer a stop string ended: that string.
    stop_sequence: str | None = None


class ToolCallParser(Protocol):
    """Turns an answer's raw text, as it streams, into content and tool-call deltas.

    The result of feeding a text depends only on the text, not on how it was cut into pieces,
    so a resumed job can replay what was already published and continue.
    """

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New raw text in; the content and the tool-call deltas it completes out."""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The answer ended: whatever was held back."""

    @property
    def called(self) -> bool:
        """True once at least one tool call was emitted."""


class Engine(ABC):
    """A continuously batched text generator.

    `generate` may be called concurrently up to `max_seqs` times; each call streams its
    own request. Implementations never block the event loop.
    """

    # `AXON_ENGINE`'s name for it, announced with the worker's heartbeat (`/v1/models` lists it).
    name: ClassVar[str]
    model_name: str
    max_seqs: int
    # The request parameters this engine honours (beyond the ones every engine does).
    supports: ClassVar[frozenset[Capability]] = frozenset()
    # Prompt plus answer tokens one sequence may hold; known once `start` returned.
    context_tokens: int
    # The names of the LoRA adapters of the model this engine serves too (`GenerationRequest.adapter`).
    adapters: frozenset[str] = frozenset()

    @abstractmethod
    async def start(self) -> None:
        """Load the model; the worker takes jobs only after this returns."""

    @abstractmethod
    async def stop(self) -> None:
        """Release the model; in-flight requests end."""

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        """Stream the answer to `request`; the last output carries `finish_reason`."""

    @abstractmethod
    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The tokens of `request`'s prompt as `generate` would read them (its chat template,
        tools included), without generating anything."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop generating `request_id` within one engine step; its stream ends `cancelled`."""

    @abstractmethod
    async def check_health(self) -> None:
        """Raise `EngineError` if the engine cannot serve requests."""

    def tool_call_parser(self, job: Job) -> ToolCallParser | None:
        """The parser that splits this job's answer into content and tool calls (None: all content).

        The default reads Axon's own formats (`services/worker/tool_parsers.py`); an engine whose model
        writes tool calls its own way overrides this.
        """
        from services.worker.tool_parsers import parser_for  # tool_parsers.py imports this module

        return parser_for(job)

    # Engines that publish KV-cache events (`kv_events.py`) set their block size and return their
    # source from `kv_events`; the worker then keeps a prefix index (`services/worker/kv_index.py`)
    # and sets `prompt_observer`, which the engine calls with each new request's rendered prompt.
    kv_block_size = 0
    prompt_observer: Callable[[GenerationRequest, RenderedPrompt], None] | None = None

    def kv_events(self) -> KvEventSource | None:
        """The engine's KV-cache event stream, once started (None: it publishes none)."""
        return None

    # Engines that can say how full their KV cache is set this and override `kv_cache_usage`.
    reports_kv_cache = False

    def metrics(self) -> Iterable[Metric]:
        """The engine's own Prometheus metrics, served on the worker's /metrics beside Axon's
        (read at each scrape)."""
        return ()

    def kv_cache_usage(self) -> float | None:
        """Fraction of the KV cache in use (None while unknown)."""
        return None
