"""What a job's answer is constrained to (tools and structured outputs on the worker's side).

`guide_for(job)`: the `Guide` an engine enforces. A `required` or named `tool_choice` wins over
`response_format`, as in vLLM: `required` is vLLM's JSON array of `{"name", "parameters"}` objects
(`maxItems: 1` when `parallel_tool_calls` is false, which vLLM leaves to the model), named is the
function's `parameters` schema. A schema whose shortest answer cannot fit in the job's
`max_tokens` is refused (`shared/schema_bounds.py`, which the session manager checks first). The
CPU engine compiles the guide with xgrammar (`engines/grammar.py`); the vLLM engine hands it to
vLLM's structured outputs.
"""

import json
from typing import Any, Literal

from services.worker.engines.base import Guide, InvalidPrompt
from shared.errors import InvalidRequest
from shared.schema_bounds import check_fits, min_chars
from shared.schemas import FunctionSpec, Job, NamedToolChoice

# A function declared without `parameters` takes none (OpenAI's rule; vLLM's schema for it).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def guide_for(job: Job) -> Guide | None:
    """The constraint on `job`'s answer, or None when it is free text.

    Raises:
        InvalidPrompt: the tools cannot be combined into one schema (a `$defs` name two tools
            define differently), a named tool is not among them, or no answer within the job's
            `max_tokens` can follow the schema (`_schema_guide`).
    """
    max_tokens = job.sampling.max_tokens
    if job.tools:
        if isinstance(job.tool_choice, NamedToolChoice):
            return _schema_guide(named_tool_schema(job.tools, job.tool_choice.name), "tools", max_tokens)
        if job.tool_choice == "required":
            return _schema_guide(required_tools_schema(job.tools, job.parallel_tool_calls), "tools", max_tokens)
    fmt = job.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Guide("json_object")
    if fmt.json_schema is None:
        raise InvalidPrompt("response_format of type json_schema needs its json_schema.", param="response_format")
    return _schema_guide(fmt.json_schema.schema_, "response_format", max_tokens)


def _schema_guide(schema: dict[str, Any], param: Literal["response_format", "tools"], max_tokens: int) -> Guide:
    """The guide to `schema`, unless its shortest answer cannot fit in `max_tokens`
    (`shared/schema_bounds.py`): the session manager refuses such a request before its job is
    queued, and a job that was not checked (queued by an older one) is refused here rather than
    decoded toward an answer it cannot finish.

    Raises:
        InvalidPrompt: it cannot fit (naming `param`).
    """
    what = "The response_format's JSON schema" if param == "response_format" else "The tool call's schema"
    try:
        check_fits(min_chars(schema), max_tokens, param=param, what=what)
    except InvalidRequest as exc:
        raise InvalidPrompt(exc.message, param=param) from None
    return Guide("json_schema", _schema_text(schema), param)


def named_tool_schema(tools: list[FunctionSpec], name: str) -> dict[str, Any]:
    """The schema of a call forced by name: the function's parameters."""
    for tool in tools:
        if tool.name == name:
            return tool.parameters or _NO_PARAMETERS
    raise InvalidPrompt(f"tool_choice names the function {name!r}, which is not in tools.", param="tool_choice")


def required_tools_schema(tools: list[FunctionSpec], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for `tool_choice: required`: a non-empty array of calls of the tools, each
    `{"name": <one tool's name>, "parameters": <its parameters>}`; the tools' `$defs` are lifted
    to the top, where their `#/$defs/…` references point."""
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        params = dict(tool.parameters or _NO_PARAMETERS)
        for name, definition in params.pop("$defs", {}).items():
            if name in defs and defs[name] != definition:
                raise InvalidPrompt(f"Two tools define $defs.{name} differently; rename one of them.", param="tools")
            defs[name] = definition
        branches.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _schema_text(schema: dict[str, Any]) -> str:
    # Key order kept: it is the order the answer's properties are generated in.
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
