"""vLLM's own tool-call parsers behind Axon's `ToolCallParser` (tool_choice `auto` on the vLLM engine).

vLLM's parsers (`vllm.tool_parsers`, chosen by `AXON_TOOL_PARSER`) are streaming state machines
fed one delta at a time, the way vLLM's OpenAI server feeds them its engine's outputs: the text and
token ids so far and of the delta. Their output depends on where the deltas were cut, and the
worker hands the parser whatever text piled up between two publishes (and, after a failover, the
whole text already published at once). So `VllmToolCallParser` first cuts the text into pieces
that depend only on the text (`Segmenter`: words, runs of spaces, single punctuation marks, and
the tokenizer's added tokens such as `<tool_call>` whole) and feeds vLLM's parser one piece at a
time, with the piece's token ids. The deltas therefore depend only on the text, which is what
exact failover needs; call ids are Axon's (`tool_call_id`, from the job id and the call's index)
instead of vLLM's random ones, for the same reason.

At the end of the answer it does what vLLM's server does then: it sends the part of the last
call's arguments the parser had parsed but not yet streamed.

Nothing here imports vLLM: the engine passes in the parser instance and the request object.
"""

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from services.worker.engines.base import EngineError
from services.worker.tool_parsers import merge_deltas, tool_call_id
from shared.schemas import FunctionCallDelta, ToolCallDelta

# A run of spaces, a run of word characters, or any other single character.
_PIECE = re.compile(r"(?P<run>\s+|\w+)|[^\w\s]")
_MARK = re.compile(r"[^\w\s]")


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class Specials:
    """The tokenizer's added tokens that start with a punctuation mark (`<tool_call>`, `[TOOL_CALLS]`,
    `<|python_tag|>`, …), indexed for `Segmenter`; built once per engine."""

    def __init__(self, tokens: Iterable[str] = ()) -> None:
        kept = sorted({t for t in tokens if _MARK.match(t)}, key=len, reverse=True)
        # By first character, longest first: of two specials matching at one place, the longer wins.
        self.by_start: dict[str, list[str]] = {}
        for token in kept:
            self.by_start.setdefault(token[0], []).append(token)
        self.prefixes = frozenset(t[:i] for t in kept for i in range(1, len(t)))
        self.longest = max((len(t) for t in kept), default=0)


class Segmenter:
    """Cuts a growing text into pieces that depend only on the text, not on how it arrived.

    A piece is a special (an added token, so it arrives whole, as the single token it is), a run
    of spaces, a run of word characters, or one other character. A run at the end of the text so
    far, or text that could still become a special, is held back until the next text (or `flush`)
    settles it.
    """

    def __init__(self, specials: Specials) -> None:
        self._specials = specials
        self._pending = ""

    def push(self, text: str) -> list[str]:
        """Add `text`; return the pieces it settled."""
        self._pending += text
        return self._cut(final=False)

    def flush(self) -> list[str]:
        """The text ended: return the pieces held back."""
        return self._cut(final=True)

    def _cut(self, *, final: bool) -> list[str]:
        text = self._pending
        specials = self._specials
        pieces: list[str] = []
        pos = 0
        while pos < len(text):
            candidates = specials.by_start.get(text[pos])
            if candidates is not None:
                if not final and len(text) - pos < specials.longest and text[pos:] in specials.prefixes:
                    break  # may still become a special
                special = next((s for s in candidates if text.startswith(s, pos)), None)
                if special is not None:
                    pieces.append(special)
                    pos += len(special)
                    continue
            match = _PIECE.match(text, pos)
            assert match is not None  # the pattern matches any character
            if not final and match.lastgroup == "run" and match.end() == len(text):
                break  # the run may go on
            pieces.append(match.group())
            pos = match.end()
        self._pending = text[pos:]
        return pieces


def _field(obj: Any, name: str) -> Any:
    """An attribute of a vLLM protocol object, or a key of the dict some parsers put in its place."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


class VllmToolCallParser:
    """One answer's vLLM tool parser as an Axon `ToolCallParser` (see the module docstring)."""

    def __init__(
        self,
        parser: Any,
        request: Any,
        tokenizer: _Tokenizer,
        *,
        job_id: str,
        parallel_tool_calls: bool = True,
        specials: Specials | None = None,
    ) -> None:
        """`parser`: a fresh instance of vLLM's parser class; `request`: the vLLM
        `ChatCompletionRequest` it was adjusted for (its `tools`, `tool_choice="auto"`)."""
        self._parser = parser
        self._request = request
        self._tokenizer = tokenizer
        self._job_id = job_id
        self._parallel = parallel_tool_calls
        self._segmenter = Segmenter(specials or Specials())
        self._text = ""
        self._token_ids: list[int] = []
        # Calls whose first delta was sent: their index -> id.
        self._ids: dict[int, str] = {}

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return self._run(self._segmenter.push(text))

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self._run(self._segmenter.flush())
        rest = self._unstreamed_arguments()
        if rest is not None:
            deltas.append(rest)
        return content, merge_deltas(deltas)

    def _run(self, pieces: Sequence[str]) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for piece in pieces:
            message = self._step(piece)
            if message is None:
                continue
            if text := _field(message, "content"):
                content.append(text)
            for call in _field(message, "tool_calls") or ():
                delta = self._delta(call)
                if delta is not None:
                    deltas.append(delta)
        return "".join(content), merge_deltas(deltas)

    def _step(self, piece: str) -> Any:
        """One piece through vLLM's parser, with the arguments vLLM's server passes."""
        piece_ids = list(self._tokenizer.encode(piece, add_special_tokens=False))
        previous_text, previous_ids = self._text, self._token_ids
        current_text, current_ids = previous_text + piece, previous_ids + piece_ids
        try:
            message = self._parser.extract_tool_calls_streaming(
                previous_text=previous_text,
                current_text=current_text,
                delta_text=piece,
                previous_token_ids=previous_ids,
                current_token_ids=current_ids,
                delta_token_ids=piece_ids,
                request=self._request,
            )
        except Exception as exc:
            raise EngineError(f"vLLM's tool parser failed on the answer: {exc}") from exc
        self._text, self._token_ids = current_text, current_ids
        return message

    def _delta(self, call: Any) -> ToolCallDelta | None:
        """vLLM's `DeltaToolCall` as Axon's: the call's first delta gets Axon's id and `type`."""
        index = int(_field(call, "index") or 0)
        if not self._parallel and index > 0:
            return None  # parallel_tool_calls=false: the first call only (as vLLM's server filters)
        function = _field(call, "function")
        name, arguments = _field(function, "name"), _field(function, "arguments")
        opening = index not in self._ids
        if opening and name is None:
            return None  # no call starts without its name
        call_id = None
        if opening:
            call_id = self._ids[index] = tool_call_id(self._job_id, index)
        if name is None and arguments is None and call_id is None:
            return None
        return ToolCallDelta(
            index=index,
            id=call_id,
            type="function" if call_id is not None else None,
            function=FunctionCallDelta(name=name if opening else None, arguments=arguments),
        )

    def _unstreamed_arguments(self) -> ToolCallDelta | None:
        """What vLLM's server sends when the answer ends: the last call's arguments as the parser
        parsed them (`prev_tool_call_arr`), less what it streamed (`streamed_args_for_tool`), when
        what it streamed is a prefix of them."""
        calls = getattr(self._parser, "prev_tool_call_arr", None) or []
        streamed = getattr(self._parser, "streamed_args_for_tool", None) or []
        index = len(calls) - 1
        if index < 0 or index >= len(streamed) or index not in self._ids:
            return None
        arguments = _field(calls[index], "arguments")
        if arguments is None:
            return None
        expected = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        sent = streamed[index]
        if len(expected) <= len(sent) or not expected.startswith(sent):
            return None
        return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=expected[len(sent) :]))
