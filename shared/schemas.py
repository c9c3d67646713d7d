"""Wire schemas that cross a service boundary: the job and the token chunk (docs/architecture.md).

Plain pydantic only: no torch, vllm or fastapi import, so every service can use them. These are
the only definition of the messages: the session manager builds jobs and reads chunks through
them, the worker reads jobs and builds chunks through them.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# `tool_calls`: the answer is one or more tool calls (tool_choice `auto` or `required`; a call
# forced by name ends `stop`, as OpenAI's do).
FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]
Role = Literal["system", "user", "assistant", "tool", "developer"]


class FunctionCall(BaseModel):
    """A tool call's function: its name and its arguments as a JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A complete tool call, as an assistant message holds it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One chat message with its content flattened to text.

    An assistant message may carry `tool_calls` (its content is then often empty); a `tool`
    message answers the call `tool_call_id`.
    """

    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(BaseModel):
    """A function the model may call: OpenAI's `tools[].function`."""

    name: str
    description: str | None = None
    # A JSON Schema object; None means no parameters.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: the answer is a call of it, arguments constrained."""

    name: str


# `auto`: the model decides (calls are parsed from its text); `required`: at least one call,
# constrained to the tools' schemas. `none` never reaches a job: the session manager sends no tools.
ToolChoice = Literal["auto", "required"] | NamedToolChoice


class JsonSchemaFormat(BaseModel):
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`, enforced by constrained decoding (`json_object`: any JSON object)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(BaseModel):
    """Sampling parameters a worker's engine honours for one job.

    `None` means "the model's default": its generation config where it has one, else OpenAI's
    (temperature 1, top_p 1, no top_k).
    """

    max_tokens: int = Field(256, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # -1 or 0: no top-k.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    # Token id -> bias added to its logit, in [-100, 100].
    logit_bias: dict[int, float] = Field(default_factory=dict)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False


class Job(BaseModel):
    """A generation request on its way from the session manager to a worker (RabbitMQ body).

    A request for `n` choices is `n` jobs, one per choice (choice `i` with seed `seed + i`), so each
    choice fails over on its own.
    """

    job_id: str
    # The served model whose queue the job goes to (a pool's base model when it names an adapter).
    model: str
    # A LoRA adapter of `model` the answer comes from (its public model name); None: the base model.
    adapter: str | None = None
    messages: list[Message] | None = None
    prompt: str | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    channel: str
    deadline: float = Field(description="Unix time (seconds) after which the job is worthless")
    session_id: str | None = None
    tenant: str = "anonymous"
    # The API key the request came with: a worker whose final chunk nobody receives records the
    # job's usage row under it itself (the session manager that would have is gone).
    key_id: str | None = None
    # A batch line's job: its usage row is marked as batch usage.
    batch: bool = False
    # Tools the model may call; None: no tools (tool_choice `none` included).
    tools: list[FunctionSpec] | None = None
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # Log probabilities: None for none; k >= 0 for the sampled token's plus the k most likely.
    logprobs: int | None = Field(None, ge=0, le=20)
    # Completions only: the answer starts with the prompt (and its logprobs, with `logprobs`).
    echo: bool = False
    # Set when the job was queued while no worker of its model was live (scale to zero): its
    # requester stops waiting at this Unix time unless the answer has begun, so a worker that takes
    # it later, with nothing of it published yet, skips it.
    start_by: float | None = None
    # The request parameters (`Capability` names) the job uses that no live worker could be asked
    # about when it was queued: a worker whose engine does not honour one refuses the job.
    requires: list[str] = Field(default_factory=list)
    # Keep the job's chunks in its log (`Names.chunk_log`) for this many seconds after the last
    # one, for a client that reconnects to replay them; None: no log.
    chunk_log_ttl_s: int | None = Field(None, ge=1)
    # Count the prompt's tokens as the engine reads them (its tokenizer and chat template, tools
    # included) and generate nothing: the final chunk's usage says them (`/v1/messages/count_tokens`).
    count_only: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChunkError(BaseModel):
    message: str
    type: str = "server_error"
    # The request parameter at fault and OpenAI's error code, where known (an engine's refusal).
    param: str | None = None
    code: str | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a tool call, in OpenAI's streaming shape: the first piece of call `index`
    carries its `id`, `type` and `function.name`; later ones carry pieces of `function.arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    """The log probability of one generated token, and of the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class TokenChunk(BaseModel):
    """A piece of a job's answer, published by the worker on the job's channel.

    `seq` starts at 0 and grows by one per chunk; a receiver drops a `seq` it has
    already seen, which makes redelivery and failover safe. `text` is answer content only:
    text the engine produced as tool calls travels as `tool_calls` deltas. `logprobs`, when
    the job asked for them, has one entry per token of `text` (completions: of the echoed
    prompt too, in the first chunk).
    """

    seq: int = Field(ge=0)
    text: str = ""
    n_tokens: int = Field(0, ge=0)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: ChunkError | None = None
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: list[TokenLogprob] | None = None
    # The final chunk of an answer a stop string ended: that string (Anthropic's `stop_sequence`).
    stop_sequence: str | None = None
    # The final chunk only, when the worker traces: its job span's W3C `traceparent`, which the
    # session manager's span links to (shared/tracing.py).
    traceparent: str | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


# Request parameters an engine may or may not honour. Each engine declares the ones it does
# (`Engine.supports`); workers publish them with their model in the registry, and the session
# manager refuses a request that sets one that not every live worker of its model honours (400,
# `param`). `tools` covers `tool_choice` and `parallel_tool_calls`, `logprobs` covers `top_logprobs`;
# `n` needs nothing of an engine (one job per choice), nor do `max_tokens`, `temperature`, `top_p`.
Capability = Literal[
    "tools",
    "response_format",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "seed",
    "stop",
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "echo",
]
