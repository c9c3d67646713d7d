"""The prefix index: which worker's KV cache holds which prefix of a prompt, learned from the
engines' own KV-cache events (docs/architecture.md, "Routing: the prefix index").

A prompt is named by *anchors*: a chain of 16-byte keys over its text, one at the end of every
`ANCHOR_CHARS` characters of each message's content and one at each message's end, each the hash
of the previous key and its piece of text (so an anchor stands for everything before it). The
chain starts from the request's adapter and tools (a template renders tools before the messages).
The session manager computes a request's anchors from its text alone: no tokenizer, no chat
template (about 50 us of CPU for a 7,700-character prompt, `benchmarks/prefix_routing.py
--cost`).

Each worker whose engine publishes KV-cache events translates them into anchors
(`services/worker/kv_index.py`): when it renders a prompt it knows which of the engine's blocks end
before each anchor; an anchor is in its set while the engine holds that block. The sets live in
Redis, one per model and worker (`Names.prefix_index`), so every session manager reads the same
truth with one pipelined round trip; the worker alone writes its own set.

Only the sets of a model's live, not draining workers that announced an index are read
(`LiveModel.indexed`): a dead worker's set is never consulted and expires
(`PREFIX_INDEX_TTL_S`), and a set under a model the worker does not serve is never read.
"""

import asyncio
import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import orjson

from shared.names import Names
from shared.redis_pipe import RedisPipe
from shared.schemas import FunctionSpec, Message

# Characters of a message's content between two anchors: about 64 tokens of English text, so an
# anchor every 4 of vLLM's 16-token blocks (the index's resolution; a prefix is matched to the
# last anchor it holds).
ANCHOR_CHARS = 256
# Characters of content (two anchors, ~128 tokens) a prompt needs to be routed on the index: a
# shorter prefix saves too little prefill to route on, so session managers do not look it up and
# workers do not tie its anchors (`routed`).
MIN_ROUTED_CHARS = 2 * ANCHOR_CHARS
# A worker's set expires this long after its last write (it refreshes it every few seconds while
# it lives): a killed worker's set goes on its own.
PREFIX_INDEX_TTL_S = 60


@dataclass(frozen=True, slots=True)
class Anchor:
    """One anchor of a prompt: its key, and where it ends: in message `part` (0 for a completion's
    prompt), after `end` characters of that message's content."""

    key: bytes
    part: int
    end: int


def anchors(
    *,
    messages: Sequence[Message] | None,
    prompt: str | None,
    tools: Sequence[FunctionSpec] | None = None,
    adapter: str | None = None,
) -> list[Anchor]:
    """The anchors of a request's prompt (messages, or a completion's prompt). A message with tool
    calls, or a tool's answer, ends the chain: its rendering is the template's own, not its text."""
    head = hashlib.blake2b((adapter or "").encode(), digest_size=16)
    if tools:
        head.update(orjson.dumps([tool.model_dump(exclude_none=True) for tool in tools], option=orjson.OPT_SORT_KEYS))
    key = head.digest()
    found: list[Anchor] = []
    if messages is None:
        _content_anchors(key, prompt or "", 0, found)
        return found
    for part, message in enumerate(messages):
        if message.tool_calls or message.role == "tool":
            break
        key = _chained(key, f"\x00{message.role}\x00{message.name or ''}\x00".encode())
        key = _content_anchors(key, message.content, part, found)
    return found


def routed(messages: Sequence[Message] | None, prompt: str | None) -> bool:
    """Whether a prompt is long enough to be routed on the index (`MIN_ROUTED_CHARS`)."""
    return sum(len(m.content) for m in messages or ()) + len(prompt or "") >= MIN_ROUTED_CHARS


def _content_anchors(key: bytes, content: str, part: int, found: list[Anchor]) -> bytes:
    for start in range(0, len(content), ANCHOR_CHARS):
        end = min(start + ANCHOR_CHARS, len(content))
        key = _chained(key, content[start:end].encode())
        found.append(Anchor(key, part, end))
    return key


def _chained(key: bytes, piece: bytes) -> bytes:
    return hashlib.blake2b(key + piece, digest_size=16).digest()


def furthest(flags: Sequence[int]) -> int:
    """How far into a prompt's anchors a worker holds it: 1 + the index of the last anchor set in
    `flags` (SMISMEMBER's answer), 0 for none. An anchor stands for the whole text before it, so
    the anchors before it need not be set: those within the prompt's first block never are (no
    whole block ends before them)."""
    for index in range(len(flags) - 1, -1, -1):
        if flags[index]:
            return index + 1
    return 0


class PrefixIndex:
    """The session manager's reads of the index."""

    def __init__(self, pipe: RedisPipe, names: Names) -> None:
        self._pipe = pipe
        self._names = names

    async def matches(self, model: str, keys: Sequence[bytes], workers: Collection[str]) -> dict[str, int]:
        """For each of `workers`, how far into the anchor `keys` its engine holds the prompt
        (`furthest`; one pipelined round trip: one SMISMEMBER per worker).

        Raises:
            redis errors: Redis did not answer (the caller routes by today's rules).
        """
        if not keys or not workers:
            return {}
        ordered = sorted(workers)
        replies = await asyncio.gather(
            *(self._pipe.submit("SMISMEMBER", self._names.prefix_index(model, w), *keys) for w in ordered)
        )
        return {worker: furthest(reply) for worker, reply in zip(ordered, replies, strict=True)}
