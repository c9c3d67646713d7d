"""The body of Anthropic's `POST /v1/messages` (and `/v1/messages/count_tokens`), as far as Axon
honours it, and its translation into the chat completion it runs as.

Plain pydantic (no fastapi), like `shared/responses_requests.py`: the session manager validates
bodies with it (`parse_message_create`) and the gateway's OpenAPI document is generated from it.

A Messages request runs as one chat completion (`MessageCreate.chat_request`): `system` (a string
or text blocks) is a system message; each message's text blocks are its text; an assistant's
`tool_use` blocks are its `tool_calls` (`input` as JSON arguments); a user's `tool_result` blocks
are `tool` messages answering their `tool_use_id` (before the user's text, as Anthropic orders
them; `is_error` prefixes the result with "Error: "); `max_tokens`, `stop_sequences`,
`temperature`, `top_p`, `top_k` are its sampling; `metadata.user_id` its `user`; `tools` its
function tools (`input_schema` the parameters) and `tool_choice` its `tool_choice` (`auto`, `any`
as `required`, `tool` as a named function, `none`; `disable_parallel_tool_use` as
`parallel_tool_calls: false`).

Nothing is silently dropped: what the model cannot do (image, document and thinking blocks,
server tools, `thinking` enabled, a prefilled assistant answer) and any unknown field is a 400
naming the field (`param`, and the message starts with it: "messages.0.content.1.type: ..."), as
Anthropic words its own. `cache_control` is accepted anywhere Anthropic takes it and asks for
nothing more: the engines cache prompt prefixes by themselves.
"""

import json
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import InvalidRequest
from shared.openai_requests import (
    MAX_TOOLS,
    NAME_PATTERN,
    ChatCompletionRequest,
    RequestLimits,
    json_schema_extra,
)

# Axon's bound on `stop_sequences` (Anthropic documents none; every engine takes any number).
MAX_STOP_SEQUENCES: Final = 16
# The prefix of a `tool_use` block's id, as Anthropic's look (`toolu_...`).
TOOL_USE_PREFIX: Final = "toolu_"
# Block types Anthropic defines that no model served here can take or give.
_NOT_SERVED = "image, document, thinking, redacted_thinking, search_result and server tool blocks are not supported"


class CacheControl(BaseModel):
    """A prompt-cache breakpoint: accepted, and needs nothing (the engines cache prefixes by themselves)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    # An earlier answer's citations, as a client sends its blocks back: null (no model here cites).
    citations: None = None


class DirectCaller(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["direct"]


class ToolUseBlock(BaseModel):
    """A tool call the assistant made (in an assistant message)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256, pattern=r"^[a-zA-Z0-9_-]+$")
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # As an answer's block is sent back: called by the model itself (no server tools here).
    caller: DirectCaller | None = None


class ToolResultBlock(BaseModel):
    """A tool call's result (in a user message): a string or text blocks; `is_error`: it failed."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256, pattern=r"^[a-zA-Z0-9_-]+$")
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        content = self.content
        text = content if isinstance(content, str) else "".join(block.text for block in content or ())
        return f"Error: {text}" if self.is_error else text


UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")]


class UserMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)] = Field(
        description="Text, or `text` and `tool_result` blocks."
    )


class AssistantMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["assistant"]
    content: str | Annotated[list[AssistantBlock], Field(min_length=1)] = Field(
        description="Text, or `text` and `tool_use` blocks."
    )


MessageParam = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class InputSchema(BaseModel):
    """A tool's `input_schema`: a JSON Schema of an object."""

    model_config = ConfigDict(extra="allow")

    type: Literal["object"]


class ToolParam(BaseModel):
    """A client tool (a function the model may call): `type` absent or `custom`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["custom"] | None = None
    name: str = Field(json_schema_extra={"pattern": NAME_PATTERN})
    description: str | None = None
    input_schema: InputSchema = Field(description="A valid JSON Schema of the tool's input (an object).")
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ToolChoiceAuto(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["none"]


ToolChoiceParam = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingParam(BaseModel):
    """Extended thinking: only `disabled` is honoured (no model served here thinks apart)."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra=json_schema_extra(properties={"type": {"const": "disabled"}})
    )

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MetadataParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str | None = Field(None, max_length=256, description="An end-user identifier, logged.")


class _MessagesBody(BaseModel):
    """What `POST /v1/messages` and `/v1/messages/count_tokens` share: the prompt and the tools."""

    # A tool_choice other than none/auto needs tools, as `check` says.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra=json_schema_extra(
            anyOf=[
                {"properties": {"tool_choice": {"properties": {"type": {"enum": ["auto", "none"]}}}}},
                {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
            ]
        ),
    )

    model: str = Field(min_length=1, max_length=256, description="A model name or alias.")
    messages: list[MessageParam] = Field(
        min_length=1, max_length=100_000, description="The conversation; the last message is the user's."
    )
    system: str | list[TextBlock] | None = Field(None, description="A system prompt: text, or text blocks.")
    tools: list[ToolParam] | None = Field(
        None, max_length=MAX_TOOLS, description="Client tools only (functions the model may call)."
    )
    tool_choice: ToolChoiceParam | None = Field(
        None, description="`auto` (the default with tools), `any`, `tool` (by `name`, one of `tools`) or `none`."
    )
    thinking: ThinkingParam | None = Field(None, description="Only `disabled`: no model served here thinks apart.")
    cache_control: CacheControl | None = None

    def check(self) -> None:
        """The rules a JSON Schema cannot say (tools aside: `chat_request` checks them).

        Raises:
            InvalidRequest: one is broken (`param` names the field).
        """
        if self.thinking is not None and self.thinking.type != "disabled":
            raise _invalid("thinking", "extended thinking is not supported by the models served here.")
        if self.messages[-1].role != "user":
            raise _invalid(
                f"messages.{len(self.messages) - 1}.role",
                "the last message must be the user's: prefilling the assistant's answer is not supported.",
            )
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not self.tools:
            raise _invalid("tool_choice", f"tool_choice of type '{choice.type}' needs tools.")
        if isinstance(choice, ToolChoiceTool) and choice.name not in {tool.name for tool in self.tools or ()}:
            raise _invalid("tool_choice.name", f"tool_choice names the tool '{choice.name}', which is not in tools.")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The prompt as chat messages (`system`, then each message's, in order)."""
        out: list[dict[str, Any]] = []
        system = self.system
        if isinstance(system, list):
            system = "".join(block.text for block in system)
        if system:
            out.append({"role": "system", "content": system})
        for message in self.messages:
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif isinstance(message, UserMessage):
                out.extend(_user_messages(message))
            else:
                out.append(_assistant_message(message))
        return out

    def _chat_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema.model_dump(),
                        "strict": tool.strict,
                    },
                }
                for tool in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceTool):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if getattr(choice, "disable_parallel_tool_use", None):
            body["parallel_tool_calls"] = False
        return body


class MessageCreate(_MessagesBody):
    """Anthropic's `MessageCreateParams`, as far as Axon honours it."""

    max_tokens: int = Field(ge=1, description="The most tokens to generate (at most the model's context).")
    stop_sequences: list[str] | None = Field(
        None, max_length=MAX_STOP_SEQUENCES, description="Text that ends the answer (`stop_reason: stop_sequence`)."
    )
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="0: no top-k.")
    metadata: MetadataParam | None = None
    stream: bool | None = Field(False, description="Answer as server-sent events.")

    def chat_request(self, limits: RequestLimits) -> ChatCompletionRequest:
        """The chat completion this request runs as, checked (`check` first). A 400 names the
        Messages body's field (`tools.0.input_schema`, not `tools.0.function.parameters`).

        Raises:
            InvalidRequest: a rule is broken (`param` names the field).
        """
        self.check()
        body = self._chat_body()
        body.update(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            user=self.metadata.user_id if self.metadata is not None else None,
            stream=bool(self.stream),
        )
        request = _checked_chat(body, limits)
        # Anthropic's bound, not OpenAI's four.
        request.stop = list(self.stop_sequences) if self.stop_sequences else None
        return request


class CountTokensRequest(_MessagesBody):
    """Anthropic's `MessageCountTokensParams`, as far as Axon honours it."""

    def chat_request(self, limits: RequestLimits) -> ChatCompletionRequest:
        """The chat completion whose prompt is counted (`max_tokens` 1: what admission reserves;
        a count-only job generates nothing), checked.

        Raises:
            InvalidRequest: a rule is broken (`param` names the field).
        """
        self.check()
        body = self._chat_body()
        body["max_tokens"] = 1
        return _checked_chat(body, limits)


def _user_messages(message: UserMessage) -> list[dict[str, Any]]:
    """A user message of blocks: its tool results as `tool` messages, then its text, if any."""
    out: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
        elif isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _assistant_message(message: AssistantMessage) -> dict[str, Any]:
    """An assistant message of blocks: its text, and its `tool_use` blocks as tool calls (`input`
    as a JSON text: the standard library's, which writes any integer, as the workers read it)."""
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False, separators=(",", ":"))
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
    out: dict[str, Any] = {"role": "assistant", "content": texts or None}
    if calls:
        out["tool_calls"] = calls
    return out


def _checked_chat(body: dict[str, Any], limits: RequestLimits) -> ChatCompletionRequest:
    try:
        request = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}, strict=False)
        request.check(limits)
    except ValidationError as exc:
        raise messages_invalid_request(exc.errors(include_url=False), chat=True) from None
    except InvalidRequest as exc:
        raise as_messages_error(exc) from None
    return request


# Parsing and errors -----------------------------------------------------------------------------


def parse_message_create(raw: bytes | str) -> MessageCreate:
    """The body of `POST /v1/messages`, validated (not yet `check`ed: `chat_request` does).

    Raises:
        InvalidRequest: not valid JSON, or a field breaks a rule (`param` names it).
    """
    try:
        return MessageCreate.model_validate_json(raw)
    except ValidationError as exc:
        raise messages_invalid_request(exc.errors(include_url=False)) from None


def parse_count_tokens(raw: bytes | str) -> CountTokensRequest:
    """The body of `POST /v1/messages/count_tokens`, validated.

    Raises:
        InvalidRequest: not valid JSON, or a field breaks a rule (`param` names it).
    """
    try:
        return CountTokensRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise messages_invalid_request(exc.errors(include_url=False)) from None


def messages_param(param: str | None) -> str | None:
    """A chat request's `param` as the Messages body names it (`tools.0.function.parameters` is
    `tools.0.input_schema`, `stop` is `stop_sequences`, `user` is `metadata.user_id`; a message's
    is `messages`: chat messages do not map one to one)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "messages":
        return "messages"
    if head in ("max_tokens", "max_completion_tokens"):
        return "max_tokens"
    if head == "stop":
        return "stop_sequences"
    if head == "user":
        return "metadata.user_id"
    if head == "tools" and rest:
        index, _, field = rest.partition(".")
        field = field.removeprefix("function").lstrip(".")
        field = "input_schema" if field.startswith("parameters") else field
        return f"tools.{index}" + (f".{field}" if field else "")
    return param


def as_messages_error(exc: InvalidRequest) -> InvalidRequest:
    """`exc`, a chat request's 400, naming the Messages body's field (its message starting with it)."""
    param = messages_param(exc.param)
    message = exc.message
    if exc.param is not None and param is not None and param != exc.param:
        message = message.replace(exc.param, param)
    if param is not None and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    return InvalidRequest(message, param=param, code=exc.code)


def _invalid(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param, code="invalid_request")


_BLOCK_LISTS: Final = frozenset({"content", "system", "tools"})
_KNOWN_BLOCKS: Final = frozenset({"text", "tool_use", "tool_result"})


def messages_invalid_request(errors: list[Any], *, chat: bool = False) -> InvalidRequest:
    """The 400 for a body that failed validation, as Anthropic words it: "<field path>: <what>",
    the error about a block or tool type first (saying what is not served here), else the most
    specific one (a union's members each fail: the deepest says what is wrong).

    Args:
        chat: the errors are of the chat request a Messages body became (their fields are renamed).
    """
    if errors and errors[0].get("type") == "json_invalid":
        return InvalidRequest("The request body is not valid JSON.", code="invalid_request")
    typed = [(e, where) for e in errors if (where := _block_of_type_error(e)) is not None]
    if typed:
        error, where = typed[0]
        tag = (error.get("ctx") or {}).get("tag", error.get("input"))
        if where.startswith("tools"):
            return _invalid(f"{where}.type", f"tool type {tag!r} is not supported: only client tools (custom) are.")
        if tag in _KNOWN_BLOCKS:
            return _invalid(
                f"{where}.type",
                f"{tag!r} blocks are not allowed here: 'tool_use' blocks go in assistant messages, "
                "'tool_result' blocks in user messages, and only 'text' blocks in a system prompt or a tool result.",
            )
        return _invalid(f"{where}.type", f"{tag!r} blocks are not supported here ({_NOT_SERVED}).")
    first: dict[str, Any] = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    path = _path(first.get("loc", ()))
    param = messages_param(path) if chat else path
    message = str(first.get("msg", "Invalid value"))
    if first.get("type") == "extra_forbidden":
        message = "Extra inputs are not permitted"
    return InvalidRequest(f"{param}: {message}" if param else message, param=param or None, code="invalid_request")


def _block_of_type_error(error: Any) -> str | None:
    """The path of the block (or tool) whose `type` is one no field takes, if `error` says so."""
    kind = error.get("type")
    if kind not in ("union_tag_invalid", "literal_error"):
        return None
    loc = tuple(error.get("loc", ()))
    if kind == "literal_error":
        if not loc or loc[-1] != "type":
            return None
        loc = loc[:-1]
    path = _path(loc)
    parts = path.split(".")
    if len(parts) < 2 or not parts[-1].isdigit() or parts[-2] not in _BLOCK_LISTS:
        return None
    return path


def _path(loc: Any) -> str:
    """An error's `loc` as the body's field path: without the members of unions pydantic tried
    (`str`, `list[...]`, a model's name) and the tags of discriminated unions (a message's role
    after its index, a block's type after its index, `tool_choice`'s type)."""
    parts: list[str] = []
    previous: object = None
    for part in loc:
        label = isinstance(part, str) and (part in _LABELS or "[" in part or part[:1].isupper())
        tag = part in _TAGS and (isinstance(previous, int) or previous in _UNION_FIELDS)
        if not label and not tag:
            parts.append(str(part))
        previous = part
    return ".".join(parts)


_LABELS: Final = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})
# The tags of the discriminated unions (message roles, block and tool_choice types).
_TAGS: Final = frozenset({"user", "assistant", "text", "tool_use", "tool_result", "auto", "any", "tool", "none"})
# Fields holding one discriminated union (not a list of them).
_UNION_FIELDS: Final = frozenset({"tool_choice"})
