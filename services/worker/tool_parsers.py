"""Tool-call parsers: how a job's answer text splits into content and tool calls as it streams.

- `parser_for(job)`: a `ToolCallParser` for the job's `tool_choice`. Named: the whole answer is the
  arguments. Required: the answer is that JSON array (`constraints.required_tools_schema`), scanned
  as it streams. Auto: content until a Hermes-style `<tool_call>{"name": …, "arguments": …}</tool_call>`
  (or a JSON array in one tag).
  Every parser's output is a function of the text so far, never of how it was cut, so a resumed
  job replays the published raw text and continues; call ids derive from the job id and the
  call's index, so the replay finds the same ones.
- `answer_finish_reason`, `tool_call_id`, `merge_deltas`: what the answer's chunks carry, also used
  by the vLLM engine's own parsers (`engines/vllm_tools.py`).

What the answer is constrained to is `constraints.py`; how tools are written into a prompt,
`prompts.py`.
"""

import hashlib
import json
import string

from services.worker.engines.base import ToolCallParser
from shared.schemas import (
    FinishReason,
    FunctionCallDelta,
    Job,
    NamedToolChoice,
    ToolCallDelta,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_ID_ALPHABET = string.ascii_letters + string.digits


def parser_for(job: Job) -> ToolCallParser | None:
    """The parser for `job`'s answer; None when the job offers no tools (the answer is content)."""
    if not job.tools:
        return None
    if isinstance(job.tool_choice, NamedToolChoice):
        return NamedCallParser(job.job_id, job.tool_choice.name)
    if job.tool_choice == "required":
        return RequiredCallsParser(job.job_id, single=not job.parallel_tool_calls)
    return AutoCallsParser(job.job_id, single=not job.parallel_tool_calls)


def answer_finish_reason(job: Job, reason: FinishReason, called: bool) -> FinishReason:
    """`tool_calls` for an answer that made calls under `auto` or `required`; a call forced by name
    ends `stop`, as OpenAI's do. Other reasons (length, cancelled, error) stand."""
    if called and reason == "stop" and not isinstance(job.tool_choice, NamedToolChoice):
        return "tool_calls"
    return reason


def tool_call_id(job_id: str, index: int) -> str:
    """`call_` and 24 letters or digits, the same for the same job and call (a resumed job's too)."""
    digest = hashlib.blake2b(f"{job_id}|{index}".encode(), digest_size=24).digest()
    return "call_" + "".join(_ID_ALPHABET[b % len(_ID_ALPHABET)] for b in digest)


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Adjacent deltas of the same call as one: a chunk carries one delta per call (clients such as
    LangChain merge a call's pieces across chunks, not within one)."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if not merged or merged[-1].index != delta.index or delta.id is not None:
            merged.append(delta)
            continue
        last = merged[-1]
        before, after = last.function or FunctionCallDelta(), delta.function or FunctionCallDelta()
        arguments = None
        if before.arguments is not None or after.arguments is not None:
            arguments = (before.arguments or "") + (after.arguments or "")
        merged[-1] = ToolCallDelta(
            index=last.index,
            id=last.id,
            type=last.type,
            function=FunctionCallDelta(name=before.name or after.name, arguments=arguments),
        )
    return merged


class _Calls:
    """Numbers the calls of one answer and builds their deltas."""

    def __init__(self, job_id: str) -> None:
        self._job_id = job_id
        self.count = 0

    def opening(self, name: str, arguments: str = "") -> ToolCallDelta:
        """The first delta of the next call: its id, type and name (and arguments so far)."""
        index = self.count
        self.count += 1
        return ToolCallDelta(
            index=index,
            id=tool_call_id(self._job_id, index),
            type="function",
            function=FunctionCallDelta(name=name, arguments=arguments),
        )

    def arguments(self, piece: str) -> ToolCallDelta:
        """A piece of the latest call's arguments."""
        return ToolCallDelta(index=self.count - 1, function=FunctionCallDelta(arguments=piece))


class NamedCallParser:
    """`tool_choice` names the function: the answer is its arguments (constrained to its schema),
    streamed as they come; leading whitespace is dropped."""

    def __init__(self, job_id: str, name: str) -> None:
        self._name = name
        self._calls = _Calls(job_id)

    @property
    def called(self) -> bool:
        return self._calls.count > 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.called:
            return "", [self._calls.arguments(text)] if text else []
        text = text.lstrip()
        return "", [self._calls.opening(self._name, text)] if text else []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []


# The keys of a `required` call whose values are read; any other key's value is skipped.
_CALL_FIELDS = {"name": "name", "parameters": "parameters", "arguments": "parameters"}


class RequiredCallsParser:
    """`tool_choice: required`: the answer is a JSON array of `{"name": …, "parameters": {…}}`
    (`required_tools_schema`). A small scanner follows it character by character: a call opens
    once its name is read, and its parameters stream as its arguments (held until the name is
    known if they come first). With `single`, calls after the first are dropped. An answer in
    which no call could be read is content, given at the end."""

    def __init__(self, job_id: str, *, single: bool) -> None:
        self._calls = _Calls(job_id)
        self._single = single
        self._raw: list[str] = []
        # The JSON text's lexical state.
        self._depth = 0  # brackets open: 1 inside the array, 2 inside one of its objects
        self._in_string = False
        self._escape = False
        # Where the scanner is in the array's current object.
        self._element = -1
        self._expect = ""  # "key", "colon", "value" or "next"
        self._key: list[str] | None = None  # the key being read
        self._last_key = ""
        self._field = ""  # the value being read: "name", "parameters", "skip"; "" between values
        self._scalar = False  # that value is a number, true, false or null
        self._value_depth = 0
        self._name: list[str] = []
        self._held: list[str] = []  # parameters read before the name
        self._opened = False  # the object's call was emitted
        self._has_parameters = False

    @property
    def called(self) -> bool:
        return self._calls.count > 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if not text:
            return "", []
        self._raw.append(text)
        out: list[ToolCallDelta] = []
        pieces: list[str] = []  # the open call's arguments read since its last delta
        for ch in text:
            self._step(ch, out, pieces)
        self._flush(out, pieces)
        return "", merge_deltas(out)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return ("", []) if self.called else ("".join(self._raw), [])

    @property
    def _skipped(self) -> bool:
        return self._single and self._element > 0

    def _step(self, ch: str, out: list[ToolCallDelta], pieces: list[str]) -> None:
        if self._scalar and (ch in ",]}" or ch.isspace()):
            self._end_value(out, pieces)
        if self._field:
            self._value_char(ch, out, pieces)
        elif self._in_string:
            self._in_string = self._still_in_string(ch)
            if self._key is not None and self._in_string:
                self._key.append(ch)
            elif self._key is not None:
                self._last_key, self._key, self._expect = "".join(self._key), None, "colon"
        elif self._depth == 2 and self._expect == "value" and not ch.isspace() and ch not in ",]}":
            self._field = _CALL_FIELDS.get(self._last_key, "skip")
            self._value_depth = self._depth
            if self._field == "name":
                self._name = []
            self._value_char(ch, out, pieces, first=True)
        elif not ch.isspace():
            self._structure_char(ch, out, pieces)

    def _structure_char(self, ch: str, out: list[ToolCallDelta], pieces: list[str]) -> None:
        """A character outside the values the scanner reads: brackets, keys, colons, commas."""
        if ch == '"':
            self._in_string = True
            if self._depth == 2 and self._expect == "key":
                self._key = []
        elif ch in "[{":
            self._depth += 1
            if self._depth == 2 and ch == "{":
                self._element += 1
                self._expect, self._name, self._held = "key", [], []
                self._opened = self._has_parameters = False
        elif ch in "]}":
            if self._depth == 2:
                self._end_element(out, pieces)
            self._depth = max(0, self._depth - 1)
        elif self._depth == 2 and ch == ":" and self._expect == "colon":
            self._expect = "value"
        elif self._depth == 2 and ch == "," and self._expect == "next":
            self._expect = "key"

    def _value_char(self, ch: str, out: list[ToolCallDelta], pieces: list[str], *, first: bool = False) -> None:
        """A character of the value being read; the value ends with its closing quote or bracket
        (a scalar's end is seen by `_step`)."""
        if self._field == "name":
            self._name.append(ch)
        elif self._field == "parameters" and not self._skipped:
            self._has_parameters = True
            (pieces if self._opened else self._held).append(ch)
        if self._in_string:
            self._in_string = self._still_in_string(ch)
            if not self._in_string and self._depth == self._value_depth:
                self._end_value(out, pieces)
        elif ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1
            if self._depth == self._value_depth:
                self._end_value(out, pieces)
        elif first:
            self._scalar = True

    def _still_in_string(self, ch: str) -> bool:
        """Whether the string `ch` is read in goes on after it."""
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            return False
        return True

    def _end_value(self, out: list[ToolCallDelta], pieces: list[str]) -> None:
        field, self._field, self._scalar, self._expect = self._field, "", False, "next"
        if field != "name" or self._opened or self._skipped:
            return
        try:
            name = json.loads("".join(self._name))
        except ValueError:
            return
        if isinstance(name, str):
            out.append(self._calls.opening(name, "".join(self._held)))
            self._opened, self._held = True, []

    def _end_element(self, out: list[ToolCallDelta], pieces: list[str]) -> None:
        if self._scalar:
            self._end_value(out, pieces)
        if self._opened and not self._has_parameters:
            pieces.append("{}")
        self._flush(out, pieces)
        self._opened, self._expect = False, ""

    def _flush(self, out: list[ToolCallDelta], pieces: list[str]) -> None:
        """The open call's arguments read since its last delta, as one delta."""
        if pieces:
            out.append(self._calls.arguments("".join(pieces)))
            pieces.clear()


class AutoCallsParser:
    """`tool_choice: auto`: content streams until `<tool_call>`; text that may be the start of that
    tag is held back. Each `<tool_call>…</tool_call>` holds a call `{"name": …, "arguments": …}`
    (`parameters` is accepted too, and arguments given as a JSON text) or a JSON array of them,
    and becomes those calls once the tag closes. Whitespace before a call, and at the end of an
    answer that made calls, is dropped. A tag that does not parse ends the parsing: it and all
    that follows is content, given at the end. With `single`, calls after the first are dropped."""

    def __init__(self, job_id: str, *, single: bool) -> None:
        self._calls = _Calls(job_id)
        self._single = single
        self._buffer = ""  # held content, or the open tag's text
        self._in_tag = False
        self._space = ""  # whitespace after the last content, held back
        self._dropped_space = ""  # the whitespace dropped before the open tag
        self._failed: str | None = None  # the raw text from a tag that did not parse on

    @property
    def called(self) -> bool:
        return self._calls.count > 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._failed is not None:
            self._failed += text
            return "", []
        self._buffer += text
        content: list[str] = []
        out: list[ToolCallDelta] = []
        while self._failed is None:
            if self._in_tag:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_END) :]
                self._in_tag = False
                if not self._take(body, out):
                    self._failed = self._dropped_space + TOOL_CALL_START + body + TOOL_CALL_END + self._buffer
                    self._buffer = ""
                continue
            start = self._buffer.find(TOOL_CALL_START)
            if start >= 0:
                content.append(self._content(self._buffer[:start]))
                self._dropped_space, self._space = self._space, ""
                self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
                self._in_tag = True
                continue
            keep = _partial_tag_length(self._buffer)
            content.append(self._content(self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return "".join(content), merge_deltas(out)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        out: list[ToolCallDelta] = []
        if self._in_tag and self._failed is None:
            body, self._buffer, self._in_tag = self._buffer, "", False
            if not self._take(body, out):  # an unclosed tag: a call if what it holds parses
                self._failed = self._dropped_space + TOOL_CALL_START + body
        if self._failed is not None:
            rest, self._failed = self._failed, ""
            return rest, merge_deltas(out)
        rest = self._space + self._buffer
        self._space = self._buffer = ""
        return (rest.rstrip() if self.called else rest), merge_deltas(out)

    def _content(self, text: str) -> str:
        """Content to give now; whitespace at its end is held until more content follows."""
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept) :]
        return kept

    def _take(self, body: str, out: list[ToolCallDelta]) -> bool:
        """The calls a tag holds, out as deltas; False if it does not hold calls."""
        calls = parse_calls(body)
        if calls is None:
            return False
        for name, arguments in calls:
            if self._single and self._calls.count:
                break
            out.append(self._calls.opening(name, arguments))
        return True


def parse_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls written in a `<tool_call>` tag, as (name, arguments JSON text); None if it holds
    something else."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def _partial_tag_length(text: str) -> int:
    """The length of the longest end of `text` that begins `<tool_call>`."""
    for size in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-size:]):
            return size
    return 0
