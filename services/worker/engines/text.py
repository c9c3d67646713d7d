"""Text helpers engines share: incremental detokenization and stop strings."""

from collections.abc import Callable, Sequence

# Tokens before the read point decoded again, so a token whose text depends on its left
# neighbour (a leading space, a multi-byte character) decodes right after a resume.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    The same method vLLM uses: decode a short window before and after the last read
    point and emit only the difference, holding back text that ends in an incomplete
    character.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], *, prefix_len: int = 0) -> None:
        """`prefix_len`: tokens at the start of every sequence passed to `step` whose text was
        already emitted (a resumed answer); a few of them are decoded again for context."""
        self._decode = decode
        self._prefix_offset = max(0, prefix_len - _CONTEXT_TOKENS)
        self._read_offset = prefix_len

    def step(self, token_ids: Sequence[int]) -> str:
        """Return the new text that `token_ids` (the whole sequence so far) adds."""
        prefix_text = self._decode(token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(token_ids)
        return new_text[len(prefix_text) :]


class StopMatcher:
    """Cuts generated text at the first stop string (which is not returned).

    Text that could be the start of a stop string is held back until it is known not
    to be one.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False
        # The stop string that ended the text (the first in it), once `stopped`.
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add generated text; return what is safe to emit now."""
        if not self._stops:
            return text
        self._pending += text
        found = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
        cut = min(found)[0] if found else -1
        if cut >= 0:
            self.stopped = True
            self.matched = min(found)[1]
            out, self._pending = self._pending[:cut], ""
            return out
        safe = len(self._pending) - self._hold
        if safe <= 0:
            return ""
        out, self._pending = self._pending[:safe], self._pending[safe:]
        return out

    def flush(self) -> str:
        """Return the held-back text at the end of generation."""
        out, self._pending = self._pending, ""
        return out
