"""Tools in a prompt: a conversation with tools, tool calls and tool results as plain role/content
turns, for chat templates that know nothing of tools (Qwen2.5's wording, Hermes-style
`<tool_call>` tags, which `tool_parsers.py` reads back out of the answer).
"""

import json

from services.worker.tool_parsers import TOOL_CALL_END, TOOL_CALL_START
from shared.schemas import FunctionSpec, Message, ToolCall

DEFAULT_SYSTEM = "You are a helpful assistant."
_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)


def tool_prompt_messages(
    messages: list[Message], tools: list[FunctionSpec] | None, *, default_system: str = DEFAULT_SYSTEM
) -> list[dict[str, str]]:
    """`messages` as role/content turns for a chat template that knows nothing of tools, in the
    Hermes/Qwen2.5 way: the tools in a system block (appended to the conversation's system
    message, else to `default_system`), an assistant's calls as `<tool_call>` text, and tool
    results as a user turn of `<tool_response>` blocks (consecutive results in one turn).
    `developer` messages become `system` ones."""
    turns: list[dict[str, str]] = []
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.content}\n</tool_response>"
            if turns and turns[-1]["role"] == "user" and turns[-1].get("_tool") == "1":
                turns[-1]["content"] += "\n" + response
            else:
                turns.append({"role": "user", "content": response, "_tool": "1"})
            continue
        content = message.content
        if message.tool_calls:
            calls = "\n".join(_call_text(call) for call in message.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        turns.append({"role": "system" if message.role == "developer" else message.role, "content": content})
    for turn in turns:
        turn.pop("_tool", None)
    if tools:
        block = _TOOLS_INTRO + "".join("\n" + _tool_json(tool) for tool in tools) + _TOOLS_OUTRO
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] += "\n\n" + block
        else:
            turns.insert(0, {"role": "system", "content": f"{default_system}\n\n{block}"})
    return turns


def _tool_json(tool: FunctionSpec) -> str:
    function = tool.model_dump(exclude_none=True, exclude={"strict"})
    return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


def _call_text(call: ToolCall) -> str:
    try:
        arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    except ValueError:
        arguments = json.dumps(call.function.arguments, ensure_ascii=False)
    name = json.dumps(call.function.name, ensure_ascii=False)
    return f'{TOOL_CALL_START}\n{{"name": {name}, "arguments": {arguments}}}\n{TOOL_CALL_END}'
