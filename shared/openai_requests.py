"""OpenAI request bodies: `POST /v1/chat/completions` and `POST /v1/completions`.

Plain pydantic (no fastapi): the session manager validates bodies with them (`parse_request`) and
the gateway's OpenAPI document is generated from them. Every field of OpenAI's
CreateChatCompletionRequest / CreateCompletionRequest that Axon honours is here with OpenAI's
bounds, plus vLLM's sampling extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`) and Axon's `session_id`. Nothing is silently dropped:

- an unknown top-level field is refused as OpenAI refuses it ("Unrecognized request argument
  supplied: X", `param` null); nested objects accept extra keys, as clients send them;
- a known OpenAI field Axon does not honour (`store`, `audio`, ...) is refused naming it, unless it
  holds its no-op value (`null`, `store: false`, `service_tier: "auto"`, ...);
- a field whose engine support varies (`Capability`) is checked against the model's live workers
  by the session manager (`capabilities_used`).

The document says what `check` checks where a JSON Schema can (`json_schema_extra`: a message's
content by role, a tool_choice that needs tools, ...), so that what it accepts is accepted; what
no JSON Schema can say (a schema's own validity, a named tool_choice's function being one of
`tools`, `n` within the deployment's AXON_MAX_CHOICES, what the model's engine honours) is in the
fields' descriptions and docs/api-compatibility.md.
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import jsonschema_rs
import orjson
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, WithJsonSchema

from shared.errors import InvalidRequest, invalid_request
from shared.schemas import (
    Capability,
    FunctionSpec,
    JsonSchemaFormat,
    Message,
    NamedToolChoice,
    ResponseFormat,
    Role,
    Sampling,
    ToolCall,
    ToolChoice,
)

Kind = Literal["chat", "completion"]

# OpenAI's own bound of `n`; a deployment allows at most `AXON_MAX_CHOICES` (≤ this).
MAX_CHOICES: Final = 128
# OpenAI: "A max of 128 functions are supported."
MAX_TOOLS: Final = 128
_INT64 = 2**63
# OpenAI's rule for function and response-format names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# The JSON Schema dialects a schema may name in `$schema` (anything else would make the
# validator fetch a metaschema from the network).
_KNOWN_DIALECTS = frozenset(
    {
        "http://json-schema.org/draft-04/schema",
        "http://json-schema.org/draft-06/schema",
        "http://json-schema.org/draft-07/schema",
        "https://json-schema.org/draft/2019-09/schema",
        "https://json-schema.org/draft/2020-12/schema",
    }
)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """A deployment's bounds on request bodies, beyond OpenAI's."""

    max_choices: int = 8
    max_schema_bytes: int = 64 * 1024


# Messages ---------------------------------------------------------------------------------


def json_schema_extra(**changes: Any) -> Any:
    """A model's `json_schema_extra`: `changes` to its document's schema, keyword by keyword
    (`properties` merged property by property)."""

    def change(schema: dict[str, Any]) -> None:
        for key, value in changes.items():
            if key == "properties":
                schema["properties"].update(value)
            else:
                schema[key] = value

    return change


def unless_null(field: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema rule: `field` absent or null, or else the body matches `schema`."""
    return {"anyOf": [{"properties": {field: {"type": "null"}}}, schema]}


class TextPart(BaseModel):
    """A content part: only `text` parts are supported (others are refused naming the message)."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra=json_schema_extra(
            properties={"type": {"const": "text"}, "text": {"type": "string"}}, required=["type", "text"]
        ),
    )

    type: str
    text: str | None = None


_NOT_NULL: Final = {"type": ["string", "array"]}


class ChatMessage(BaseModel):
    """One message of `messages`: `system`, `developer`, `user`, `assistant` (content may be null)
    or `tool` (answers `tool_call_id`); only an assistant message carries `tool_calls`."""

    # What `check` checks, by role.
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra=json_schema_extra(
            anyOf=[
                {"properties": {"role": {"const": "assistant"}}},
                {
                    "properties": {
                        "role": {"enum": ["system", "developer", "user"]},
                        "content": _NOT_NULL,
                        "tool_calls": {"type": "null"},
                    },
                    "required": ["content"],
                },
                {
                    "properties": {
                        "role": {"const": "tool"},
                        "content": _NOT_NULL,
                        "tool_calls": {"type": "null"},
                        "tool_call_id": {"type": "string", "minLength": 1},
                    },
                    "required": ["content", "tool_call_id"],
                },
            ]
        ),
    )

    role: Role
    content: str | list[TextPart] | None = Field(None, description="Text, or a list of text parts.")
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant message's tool calls.")
    tool_call_id: str | None = Field(None, description="The call a `tool` message answers.")

    def check(self, index: int) -> None:
        """Raises InvalidRequest: a rule OpenAI sets on this role is broken."""
        where = f"messages.{index}"
        if self.content is None and self.role != "assistant":
            raise InvalidRequest(f"A '{self.role}' message needs content.", param=f"{where}.content")
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if part.type != "text":
                    raise InvalidRequest("Only text content parts are supported.", param=f"{where}.content")
                if part.text is None:
                    raise InvalidRequest("A text part needs its text.", param=f"{where}.content.{j}.text")
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequest("Only assistant messages carry tool_calls.", param=f"{where}.tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequest("A 'tool' message needs the tool_call_id it answers.", param=f"{where}.tool_call_id")

    def to_message(self) -> Message:
        """The message with its content flattened to text (checked by `check`)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        return Message(
            role=self.role,
            content=content or "",
            name=self.name,
            tool_calls=self.tool_calls or None,
            tool_call_id=self.tool_call_id,
        )


# Tools and response formats -----------------------------------------------------------------


class FunctionDefinition(FunctionSpec):
    name: str = Field(pattern=NAME_PATTERN, description="a-z, A-Z, 0-9, underscores and dashes; at most 64.")
    parameters: dict[str, Any] | None = Field(
        None,
        description="A valid JSON Schema of the arguments (at most AXON_MAX_SCHEMA_BYTES, 64-bit integers, a known "
        "`$schema`); none: no arguments.",
    )


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoiceParam(BaseModel):
    """`tool_choice` forcing a call of one function of `tools`."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaParam(JsonSchemaFormat):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(
        alias="schema",
        description="A valid JSON Schema the answer follows (at most AXON_MAX_SCHEMA_BYTES, 64-bit integers, a known "
        "`$schema`), which an answer within `max_tokens` can satisfy.",
    )


class ResponseFormatParam(BaseModel):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema` (that schema)."""

    model_config = ConfigDict(
        json_schema_extra=json_schema_extra(
            anyOf=[
                {"properties": {"type": {"enum": ["text", "json_object"]}}},
                {"properties": {"json_schema": {"type": "object"}}, "required": ["json_schema"]},
            ]
        )
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaParam | None = Field(None, description="Required with `type: json_schema`.")

    def to_wire(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        schema = None
        if self.json_schema is not None:
            spec = self.json_schema
            schema = JsonSchemaFormat(name=spec.name, schema_=spec.schema_, strict=spec.strict)
        return ResponseFormat(type=self.type, json_schema=schema)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False


# Request bodies -----------------------------------------------------------------------------

_Penalty = Annotated[float | None, Field(None, ge=-2.0, le=2.0)]
_TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
_LOGIT_BIAS_SCHEMA: Final = {
    "type": "object",
    "patternProperties": {"^[0-9]{1,10}$": {"type": "number", "minimum": -100.0, "maximum": 100.0}},
    "additionalProperties": False,
}


class _CommonFields(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    model: str = Field(min_length=1, max_length=256, description="A model name or alias.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(
        1,
        ge=1,
        le=MAX_CHOICES,
        description="Independent choices: at most AXON_MAX_CHOICES (default 8), a deployment's setting.",
    )
    stream: bool | None = Field(False, description="Answer as server-sent events.")
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = Field(None, description="Up to 4 stop strings.")
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    presence_penalty: _Penalty = None
    frequency_penalty: _Penalty = None
    logit_bias: Annotated[dict[_TokenId, _Bias], WithJsonSchema(_LOGIT_BIAS_SCHEMA)] | None = Field(
        None, description="Token id (a string of digits) -> bias added to its logit, in [-100, 100]."
    )
    user: str | None = Field(None, max_length=256, description="An end-user identifier, logged.")
    # vLLM's sampling extensions.
    top_k: int | None = Field(None, ge=-1, description="vLLM extension: -1 or 0 for no top-k.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM extension.")
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, description="vLLM extension: 1 for none.")
    min_tokens: int | None = Field(None, ge=0, description="vLLM extension.")
    ignore_eos: bool | None = Field(None, description="vLLM extension.")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        """How many choices to answer (`n`, null meaning 1)."""
        return self.n or 1

    def _check_common(self, limits: RequestLimits) -> None:
        if self.choices > limits.max_choices:
            raise InvalidRequest(
                f"Invalid 'n': integer above maximum value. Expected a value <= {limits.max_choices}, "
                f"but got {self.choices} instead.",
                param="n",
                code="integer_above_max_value",
            )

    def sampling(self, max_tokens: int) -> Sampling:
        """The job's sampling parameters: the request's, `None` where it left the model's default."""
        return Sampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            stop=self.stop_list,
            seed=self.seed,
            min_tokens=self.min_tokens or 0,
            ignore_eos=bool(self.ignore_eos),
        )

    def _sampling_capabilities(self) -> Iterator[Capability]:
        if self.presence_penalty:
            yield "presence_penalty"
        if self.frequency_penalty:
            yield "frequency_penalty"
        if self.repetition_penalty is not None and self.repetition_penalty != 1.0:
            yield "repetition_penalty"
        if self.logit_bias:
            yield "logit_bias"
        if self.seed is not None:
            yield "seed"
        if self.stop:
            yield "stop"
        if self.top_k not in (None, -1, 0):
            yield "top_k"
        if self.min_p:
            yield "min_p"
        if self.min_tokens:
            yield "min_tokens"
        if self.ignore_eos:
            yield "ignore_eos"


class ChatCompletionRequest(_CommonFields):
    """OpenAI's CreateChatCompletionRequest, as far as Axon honours it."""

    # The rules of `check` between fields.
    model_config = ConfigDict(
        json_schema_extra=json_schema_extra(
            allOf=[
                unless_null("top_logprobs", {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}),
                unless_null("session_id", {"properties": {"n": {"enum": [1, None]}}}),
                {
                    "anyOf": [
                        {"properties": {"tool_choice": {"enum": ["none", "auto", None]}}},
                        {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
                    ]
                },
            ]
        )
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Wins over `max_tokens`.")
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoiceParam | None = Field(
        None, description="`auto` with tools (the default), `none`, `required` (needs tools), or a function of `tools`."
    )
    parallel_tool_calls: bool | None = Field(None, description="Whether several calls may be made (default true).")
    response_format: ResponseFormatParam | None = None
    logprobs: bool | None = Field(None, description="Return each answer token's log probability.")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="With `logprobs`: also the most likely alternatives."
    )
    session_id: str | None = Field(
        None, description="Axon extension: prepend this session's history and store the new turn in it."
    )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check(self, limits: RequestLimits) -> None:
        """The rules a JSON Schema cannot say.

        Raises:
            InvalidRequest: one is broken (`param` names the field).
        """
        if not self.model_fields_set.isdisjoint(_CHAT_CHECKED):  # a plain request skips these
            self._check_fields(limits)
        for index, message in enumerate(self.messages):
            if message.content.__class__ is not str or message.role == "tool" or message.tool_calls is not None:
                message.check(index)

    def _check_fields(self, limits: RequestLimits) -> None:
        self._check_common(limits)
        if self.choices > 1 and self.session_id is not None:
            raise InvalidRequest("A session turn has one answer: n must be 1 with session_id.", param="n")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true.", param="top_logprobs")
        self._check_tools(limits)
        if self.response_format is not None:
            self._check_response_format(self.response_format, limits)

    def _check_tools(self, limits: RequestLimits) -> None:
        names: set[str] = set()
        total = 0
        for index, tool in enumerate(self.tools or ()):
            param = f"tools.{index}.function"
            if tool.function.name in names:
                raise InvalidRequest(f"Two tools are named '{tool.function.name}'.", param=f"{param}.name")
            names.add(tool.function.name)
            if tool.function.parameters is not None:
                total += check_json_schema(tool.function.parameters, f"{param}.parameters", limits.max_schema_bytes)
        if total > limits.max_schema_bytes:
            raise InvalidRequest(
                f"The tools' parameter schemas are {total} bytes together, more than the "
                f"{limits.max_schema_bytes} allowed.",
                param="tools",
            )
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return
        if not names:
            raise InvalidRequest("tool_choice other than 'none' or 'auto' needs tools.", param="tool_choice")
        if isinstance(choice, NamedToolChoiceParam) and choice.function.name not in names:
            raise InvalidRequest(
                f"tool_choice names the function '{choice.function.name}', which is not in tools.",
                param="tool_choice",
            )

    @staticmethod
    def _check_response_format(response_format: ResponseFormatParam, limits: RequestLimits) -> None:
        if response_format.type != "json_schema":
            return
        if response_format.json_schema is None:
            raise InvalidRequest("response_format of type json_schema needs json_schema.", param="response_format")
        check_json_schema(response_format.json_schema.schema_, "response_format", limits.max_schema_bytes)

    # What the job carries ---------------------------------------------------------------------

    def tool_specs(self) -> list[FunctionSpec] | None:
        """The functions the model may call; None with no tools or `tool_choice: none`."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [FunctionSpec.model_validate(tool.function.model_dump()) for tool in self.tools]

    def job_tool_choice(self) -> ToolChoice:
        if isinstance(self.tool_choice, NamedToolChoiceParam):
            return NamedToolChoice(name=self.tool_choice.function.name)
        return "required" if self.tool_choice == "required" else "auto"

    @property
    def parallel_calls(self) -> bool:
        return self.parallel_tool_calls is not False

    def job_response_format(self) -> ResponseFormat | None:
        return self.response_format.to_wire() if self.response_format else None

    @property
    def logprob_count(self) -> int | None:
        """None: no logprobs; k: the sampled token's and the k most likely."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def capabilities_used(self) -> Iterator[Capability]:
        """The engine capabilities this request needs, each named as its `param`."""
        if self.tools and self.tool_choice != "none":
            yield "tools"
        if self.response_format is not None and self.response_format.type != "text":
            yield "response_format"
        if self.logprobs:
            yield "logprobs"
        yield from self._sampling_capabilities()


# The fields `ChatCompletionRequest.check` has rules for.
_CHAT_CHECKED = frozenset({"n", "top_logprobs", "tools", "tool_choice", "response_format"})


class CompletionRequest(_CommonFields):
    """OpenAI's CreateCompletionRequest, as far as Axon honours it (one prompt per request)."""

    prompt: str | Annotated[list[str], Field(json_schema_extra={"minItems": 1, "maxItems": 1})] = Field(
        description="One prompt (a string, or a list holding exactly one string)."
    )
    logprobs: int | None = Field(
        None, ge=0, le=5, description="The sampled token's log probability and the k most likely."
    )
    echo: bool | None = Field(False, description="Start the answer with the prompt.")

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    def check(self, limits: RequestLimits) -> None:
        """Raises InvalidRequest: see `ChatCompletionRequest.check`."""
        self._check_common(limits)
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise InvalidRequest("Exactly one prompt per request is supported.", param="prompt")

    def capabilities_used(self) -> Iterator[Capability]:
        if self.logprobs is not None:
            yield "logprobs"
        if self.echo:
            yield "echo"
        yield from self._sampling_capabilities()


# Parsing ------------------------------------------------------------------------------------

# Fields whose errors name the field alone (a bad `logit_bias` entry is `param: logit_bias`).
_WHOLE_FIELDS = frozenset({"logit_bias", "stop", "prompt", "tool_choice"})


def check_json_schema(schema: dict[str, Any], param: str, max_bytes: int) -> int:
    """Check that `schema` is a valid JSON Schema of at most `max_bytes`; return its size.

    Raises:
        InvalidRequest: it is too large, holds an integer beyond 64 bits (which no engine can
            read), names an unknown `$schema`, or breaks its metaschema.
    """
    try:
        size = len(orjson.dumps(schema))
    except orjson.JSONEncodeError as exc:
        raise InvalidRequest(f"The schema cannot be used: {exc}.", param=param) from None
    if size > max_bytes:
        raise InvalidRequest(f"The schema is {size} bytes, more than the {max_bytes} allowed.", param=param)
    dialect = schema.get("$schema")
    if dialect is not None and (not isinstance(dialect, str) or dialect.rstrip("#") not in _KNOWN_DIALECTS):
        raise InvalidRequest(f"Unknown JSON Schema dialect in $schema: {dialect!r}.", param=param)
    try:
        jsonschema_rs.meta.validate(schema)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError) as exc:
        reason = str(exc).split("\n", 1)[0]
        raise InvalidRequest(f"Invalid JSON Schema: {reason}", param=param) from None
    return size


def parse_request(kind: Kind, body: bytes | str, limits: RequestLimits) -> ChatCompletionRequest | CompletionRequest:
    """The request `body` of a chat (`kind: chat`) or text completion, validated.

    Raises:
        InvalidRequest: the body is not valid JSON or breaks a rule (`param` names the field).
    """
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        request = _without_no_op_fields(model, body, exc.errors(include_url=False), _NOT_HONOURED[kind])
    request.check(limits)
    return request


# Known OpenAI fields Axon does not honour. They are not fields of the models (they would cost every
# request their validation): a body with any is refused naming it, unless each holds a value that
# asks for nothing (null, or one listed here) and the body is valid without them.
_NOT_HONOURED: dict[Kind, dict[str, tuple[Any, ...]]] = {
    "chat": {
        "store": (False,),
        "metadata": ({},),
        "service_tier": ("auto", "default"),
        "modalities": (["text"],),
        **dict.fromkeys(
            (
                "audio",
                "prediction",
                "web_search_options",
                "reasoning_effort",
                "verbosity",
                "functions",
                "function_call",
                "prompt_cache_key",
                "prompt_cache_retention",
                "prompt_cache_options",
                "safety_identifier",
                "moderation",
            ),
            (),
        ),
    },
    # best_of: as many candidates as choices (checked below) asks for none extra.
    "completion": {"best_of": (1,), "suffix": ("",)},
}


def _without_no_op_fields(
    model: type[ChatCompletionRequest] | type[CompletionRequest],
    body: bytes | str,
    errors: list[Any],
    known: Mapping[str, tuple[Any, ...]],
) -> ChatCompletionRequest | CompletionRequest:
    """The request, if what failed validation was only known unsupported fields holding no-op values.

    Raises:
        InvalidRequest: an unknown field, a known one asking for something, or any other error.
    """
    extra = {e["loc"][0]: e["input"] for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1}
    ignorable = extra.keys() & known.keys()
    rest = [e for e in errors if not (e["type"] == "extra_forbidden" and e["loc"][:1] and e["loc"][0] in ignorable)]
    if any(e["type"] == "extra_forbidden" for e in rest):
        raise invalid_request(rest)  # unknown fields, named alone
    for name in sorted(ignorable):
        value = extra[name]
        if value is not None and value not in known[name] and not (name == "best_of" and _n_of(body) == value):
            raise InvalidRequest(
                f"Unsupported parameter: '{name}' is not supported.", param=name, code="unsupported_parameter"
            )
    if rest:
        raise invalid_request(rest, whole=_WHOLE_FIELDS)
    fields = {k: v for k, v in orjson.loads(body).items() if k not in ignorable}
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise invalid_request(exc.errors(include_url=False), whole=_WHOLE_FIELDS) from None


def _n_of(body: bytes | str) -> Any:
    return orjson.loads(body).get("n") or 1
