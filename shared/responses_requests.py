"""The body of OpenAI's `POST /v1/responses`, as far as Axon honours it.

Plain pydantic (no fastapi), like `shared/openai_requests.py`: the session manager validates
bodies with it and the gateway's OpenAPI document is generated from it. A response runs as a chat
completion (`chat_request`): `input` and `instructions` become its messages (items are checked and
mapped by `services/sessions/conversations.items_to_messages`, so a bad item gets a 400 naming it,
`input[0].type`), `max_output_tokens` its `max_completion_tokens`, function `tools`, `tool_choice`
and `text.format` its `tools`, `tool_choice` and `response_format`, all checked by
`ChatCompletionRequest.check`.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shared.conversation_requests import Item, Metadata, _metadata
from shared.errors import InvalidRequest, invalid_request
from shared.openai_requests import (
    MAX_TOOLS,
    NAME_PATTERN,
    ChatCompletionRequest,
    RequestLimits,
    json_schema_extra,
    unless_null,
)
from shared.schemas import Message


def response_param(param: str | None) -> str | None:
    """A chat request's `param` as the Responses body names it (`messages.2.content` is `input`,
    `tools.0.function.name` is `tools[0].name`, `response_format` is `text.format`)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "messages":
        return "input"
    if head in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if head == "response_format":
        return "text.format"
    if head == "tools" and rest:
        index, _, field = rest.partition(".")
        field = field.removeprefix("function").lstrip(".")
        return f"tools[{index}]" + (f".{field}" if field else "")
    return param


def as_response_error(exc: InvalidRequest) -> InvalidRequest:
    """`exc`, a chat request's 400, naming the Responses body's param (in its message too)."""
    param = response_param(exc.param)
    if param == exc.param or exc.param is None or param is None:
        return exc
    return InvalidRequest(exc.message.replace(exc.param, param), param=param, code=exc.code)


class FunctionToolParam(BaseModel):
    """A function the model may call (the Responses API's flat shape: `name` at the top)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(json_schema_extra={"pattern": NAME_PATTERN})
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A valid JSON Schema of the arguments.")
    strict: bool | None = None


class FunctionToolChoiceParam(BaseModel):
    """`tool_choice` forcing a call of one function of `tools`."""

    type: Literal["function"]
    name: str


class TextFormatParam(BaseModel):
    """`text.format`: `text`, `json_object`, or `json_schema` (flat: `name`, `schema`, `strict`)."""

    # `json_schema` needs `name` and `schema` (as `chat_request` checks).
    model_config = ConfigDict(
        extra="ignore",
        populate_by_name=True,
        json_schema_extra=json_schema_extra(
            anyOf=[
                {"properties": {"type": {"enum": ["text", "json_object"]}}},
                {
                    "properties": {"name": {"type": "string", "pattern": NAME_PATTERN}, "schema": {"type": "object"}},
                    "required": ["name", "schema"],
                },
            ]
        ),
    )

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormatParam | None = None


class ConversationRef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=128)


class ResponseCreate(BaseModel):
    """OpenAI's `ResponseCreateParams`, as far as Axon honours it."""

    # The rules of `check`.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra=json_schema_extra(
            allOf=[
                unless_null("previous_response_id", {"properties": {"conversation": {"type": "null"}}}),
                {
                    "anyOf": [
                        {"properties": {"tool_choice": {"enum": ["none", "auto", None]}}},
                        {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
                    ]
                },
                # Some message to answer: an empty `input` needs history or instructions.
                {
                    "anyOf": [
                        {"properties": {"input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}}},
                        # An empty `instructions` is no system message.
                        {
                            "properties": {"instructions": {"type": "string", "minLength": 1}},
                            "required": ["instructions"],
                        },
                        *(
                            {"properties": {field: {"not": {"type": "null"}}}, "required": [field]}
                            for field in ("previous_response_id", "conversation")
                        ),
                    ]
                },
                {
                    "anyOf": [
                        {"properties": {"background": {"enum": [False, None]}}},
                        {"properties": {"store": {"enum": [True, None]}}},
                    ]
                },
            ]
        ),
    )

    model: str = Field(min_length=1, max_length=256, description="A model name or alias.")
    input: str | list[Item] = Field(
        description="A user message's text, or items: `message` (input_text parts), `function_call`, "
        "`function_call_output`."
    )
    instructions: str | None = Field(None, description="A system message for this response only.")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionToolParam] | None = Field(None, max_length=MAX_TOOLS, description="Function tools only.")
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    store: bool | None = Field(True, description="Keep the response for retrieval and `previous_response_id`.")
    metadata: Metadata | None = None
    previous_response_id: str | None = Field(None, max_length=128, description="Continue from a stored response.")
    conversation: str | ConversationRef | None = Field(
        None, description="A conversation (or `{id}`) whose items are the history and which this response extends."
    )
    stream: bool | None = False
    background: bool | None = Field(
        None,
        description="Answer at once (`queued`) and run with no client attached; poll, stream or cancel it by id. "
        "Needs `store`.",
    )
    user: str | None = Field(None, max_length=256, description="An end-user identifier, logged.")

    @field_validator("metadata")
    @classmethod
    def _within_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _metadata(value)

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @property
    def stored(self) -> bool:
        return self.store is not False

    def check(self) -> None:
        """The rules a JSON Schema cannot say (before anything is read or queued).

        Raises:
            InvalidRequest: one is broken (`param` names the field).
        """
        if self.background and not self.stored:
            raise InvalidRequest(
                "background: true needs store: a background response is kept to be retrieved.",
                param="background",
                code="invalid_value",
            )
        if self.previous_response_id is not None and self.conversation is not None:
            raise InvalidRequest(
                "previous_response_id and conversation cannot be used together.",
                param="previous_response_id",
                code="invalid_value",
            )

    def chat_request(self, messages: list[Message], limits: RequestLimits) -> ChatCompletionRequest:
        """The chat completion this response runs as, on `messages` (the whole prompt), checked.

        Raises:
            InvalidRequest: a rule of the chat request is broken (`param` names its field).
        """
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [m.model_dump(exclude_none=True) for m in messages],
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
        }
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, FunctionToolChoiceParam):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            body["response_format"] = {"type": fmt.type}
            if fmt.type == "json_schema":
                if fmt.name is None or fmt.schema_ is None:
                    raise InvalidRequest("text.format of type json_schema needs name and schema.", param="text.format")
                spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
                body["response_format"]["json_schema"] = {k: v for k, v in spec.items() if v is not None}
        try:
            request = ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None}, strict=False
            )
            request.check(limits)
        except ValidationError as exc:
            raise as_response_error(invalid_request(exc.errors(include_url=False))) from None
        except InvalidRequest as exc:
            raise as_response_error(exc) from None
        return request

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response object repeats them."""
        tools = [{**t.model_dump(exclude_none=True), "strict": t.strict} for t in self.tools or ()]
        choice: Any = self.tool_choice or "auto"
        if isinstance(choice, FunctionToolChoiceParam):
            choice = choice.model_dump()
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "store": self.stored,
            "temperature": self.temperature,
            "text": {"format": text_format},
            "tool_choice": choice,
            "tools": tools,
            "top_p": self.top_p,
            "user": self.user,
            "background": self.background is True,
        }
