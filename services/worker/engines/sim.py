"""A simulated engine for load tests of the platform itself (never the default).

A plain request gets exactly `max_tokens` short words after `ttft_ms`, one every `itl_ms`, with
`finish_reason="length"`. With a `guide` (`response_format`, or a `required` or named
`tool_choice`) the answer is a JSON value valid against the guide's schema (`json_instance`: a
small generator over the JSON Schema subset clients send), and with tools but no guide it is
one Hermes-style call `<tool_call>{"name": …, "arguments": …}</tool_call>` of a tool picked by
the prompt and seed (unless the conversation ends with a tool's result: then words, the answer
to it). Such answers come in short pieces, one per "token", and end `stop` once complete (or
`length` at `max_tokens`). A value is built only as far as `max_tokens` pieces can reach (`_Draft`),
on a thread: a schema asking for 10^9 strings of 10^9 letters (issue 29, which once held a
worker's event loop until it was killed) costs what the answer can carry. Logprobs are synthetic
but well formed (and the prompt's, for a completion's `echo`).

Token `i` depends only on the prompt, the seed, the guide and `i`, so a resumed job continues
exactly where it stopped. The simulator serves LoRA adapters by name only (`adapters`): a request
for one gets other words than the base model's (they depend on the adapter's name too), so tests
can see which the answer came from.

Each worker's simulator models a prefix cache as vLLM's automatic prefix caching works (and as
llm-d's inference simulator does): a prompt's tokens (its whitespace-separated words, the same
count as `prompt_tokens`) are cut into `BLOCK_TOKENS`-token blocks, each keyed by the hash of its
tokens and of the key of the block before it, and an LRU of `kv_blocks` keys stands for the KV
cache (a prompt's blocks are used tail first, as vLLM frees them, so its last blocks are evicted
first). The prompt's leading blocks found there are `cached_tokens`; time to first token is
`ttft_ms` plus `prefill_us_per_token` for every prompt token not cached. A finished (or cut off)
answer's blocks are cached too, after its chat prompt's `assistant:` marker, so the next turn of a
conversation, whose prompt holds this one and its answer, finds both. The cache changes only
timing and `cached_tokens`, never the text.

Tokens that are already due (a zero or very short `itl_ms`, or a sequence that fell behind)
are emitted without waiting, yielding to the event loop once every `_TOKENS_PER_STEP` of them,
as a batching engine hands out many tokens per step; so at near-zero latency the simulator
costs the worker little and the platform's own cost is what a load test measures.
"""

import asyncio
import functools
import hashlib
import json
import math
import random
import re
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from services.worker.engines.base import Engine, EngineError, EngineOutput, GenerationRequest, Guide, InvalidPrompt
from services.worker.engines.kv_events import (
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventSource,
    RenderedPrompt,
    SimKvEvents,
)
from services.worker.engines.text import StopMatcher
from services.worker.prompts import tool_prompt_messages
from services.worker.tool_parsers import TOOL_CALL_END, TOOL_CALL_START
from shared.prefix_index import routed
from shared.schemas import Capability, FinishReason, TokenLogprob, TopLogprob

_TOKENS_PER_STEP = 64
# Tokens per block of the simulated prefix cache (vLLM's default block size).
BLOCK_TOKENS = 16
# The token a chat prompt's answer follows (what a chat template's generation prompt stands for).
_ANSWER_MARKER = "assistant:"

_WORDS = (
    "the",
    "a",
    "model",
    "token",
    "stream",
    "queue",
    "worker",
    "fast",
    "data",
    "axon",
    "batch",
    "cache",
    "reply",
    "light",
    "river",
    "stone",
    "cloud",
    "green",
    "north",
    "quiet",
)


# Alternatives offered in synthetic `top_logprobs` (at least 20 besides any one token).
_ALTERNATIVES = (*_WORDS, "and", "of", "to", "in")
# Short pieces of a JSON text, one per simulated token: up to 6 letters or digits, or up to 3 other
# characters, each with at most one space before it; or a run of whitespace.
_PIECE = re.compile(r"\s?[A-Za-z0-9]{1,6}|\s?[^A-Za-z0-9\s]{1,3}|\s+")
# The most characters a piece holds (but a run of whitespace).
PIECE_CHARS = 7
# Past this depth the generator takes the shortest way out of recursive schemas; past the limit
# it gives up.
_SHALLOW_DEPTH = 4
_MAX_DEPTH = 24
# `uniqueItems`: after this many draws in a row that repeat an item, the items have run out of values.
_REPEATS = 10
_FORMATS = {
    "date-time": "2024-05-17T12:00:00Z",
    "date": "2024-05-17",
    "time": "12:00:00",
    "email": "axon@example.com",
    "uri": "https://example.com/axon",
    "url": "https://example.com/axon",
    "hostname": "example.com",
    "ipv4": "192.0.2.1",
}
# A `json_object` answer's shape.
_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "score"],
}


def prompt_text(request: GenerationRequest) -> str:
    if request.messages is not None:
        if request.tools or any(m.tool_calls or m.role == "tool" for m in request.messages):
            turns = tool_prompt_messages(request.messages, request.tools)
            return "\n".join(f"{t['role']}: {t['content']}" for t in turns)
        return "\n".join(f"{m.role}: {m.content}" for m in request.messages)
    return request.prompt or ""


def sim_word(prompt: str, seed: int | None, index: int) -> str:
    """The `index`-th word the simulator emits for this prompt and seed."""
    digest = hashlib.blake2b(f"{seed}|{index}|{prompt}".encode(), digest_size=2).digest()
    return _WORDS[int.from_bytes(digest, "big") % len(_WORDS)]


@dataclass(frozen=True, slots=True)
class JsonAnswer:
    """A JSON or tool-call answer in pieces; `whole`: False when it was built only as far as the
    request's tokens can carry (the rest would never be sent), so it must end `length`."""

    pieces: list[str]
    whole: bool


def answer_pieces(request: GenerationRequest, prompt: str, tokens: int) -> JsonAnswer | None:
    """The pieces of a JSON or tool-call answer to `request` (None for a plain one: words), built no
    further than its first `tokens` pieces need: first as far as 2 characters a piece would reach,
    then twice as far until they are there (at `PIECE_CHARS` a piece they must be)."""
    chars = 2 * tokens
    while True:
        answer = _answer_within(request, prompt, chars)
        if answer is None or answer.whole or len(answer.pieces) >= tokens or chars >= PIECE_CHARS * tokens:
            return answer
        chars *= 2


def _answer_within(request: GenerationRequest, prompt: str, chars: int) -> JsonAnswer | None:
    seed = request.sampling.seed
    draft = _Draft(chars)
    if request.guide is not None:
        try:
            text = guided_text(request.guide, prompt, seed, draft)
        except InvalidPrompt as exc:
            raise InvalidPrompt(str(exc), param=request.guide.param) from exc
        return JsonAnswer(json_pieces(text), draft.whole)
    tools = request.tools
    if not tools or (request.messages and request.messages[-1].role == "tool"):
        return None
    rng = random.Random(f"{seed}|{prompt}|tools")
    tool = tools[rng.randrange(len(tools))]
    parameters = tool.parameters or {"type": "object", "properties": {}}
    call = {"name": tool.name, "arguments": draft.instance(parameters, rng)}
    pieces = [TOOL_CALL_START, "\n", *json_pieces(json.dumps(call, ensure_ascii=False)), "\n", TOOL_CALL_END]
    return JsonAnswer(pieces, draft.whole)


async def _json_answer(request: GenerationRequest, prompt: str, tokens: int) -> JsonAnswer | None:
    """`answer_pieces` on a thread for a guided or tool-call answer: building even a bounded value
    is work in Python, and the worker's event loop (its /health, the other answers) must not wait
    on it."""
    if request.guide is None and not request.tools:
        return None
    return await asyncio.to_thread(answer_pieces, request, prompt, tokens)


def guided_text(guide: Guide, prompt: str, seed: int | None, draft: "_Draft | None" = None) -> str:
    """The JSON text the simulator answers a guided request with (built only as far as `draft`
    allows, if given)."""
    schema = _OBJECT_SCHEMA if guide.kind == "json_object" else _parsed(guide.schema or "{}")
    rng = random.Random(f"{seed}|{prompt}|{guide.schema}")
    return json.dumps((draft or _Draft()).instance(schema, rng), ensure_ascii=False)


@functools.lru_cache(maxsize=256)
def _parsed(schema: str) -> Any:
    try:
        return json.loads(schema)
    except ValueError as exc:
        raise InvalidPrompt(f"The schema is not valid JSON: {exc}") from None


def json_pieces(text: str) -> list[str]:
    """`text` cut into short pieces (their concatenation is `text`)."""
    return _PIECE.findall(text)


def json_instance(schema: Any, rng: random.Random) -> Any:
    """A value valid against `schema` (the subset clients send: object with properties, required,
    additionalProperties; array with items, prefixItems, minItems, maxItems; string with enum,
    const, minLength, maxLength and common formats; integer and number with bounds; boolean;
    null; anyOf (any branch), oneOf (the first), allOf; `$ref` into the document), chosen by `rng`.

    Raises:
        InvalidPrompt: the schema admits nothing the generator can build (or nests too deep).
    """
    return _Draft().instance(schema, rng)


class _Draft:
    """Builds a value of a schema, left to right as its JSON text reads, no further than `max_chars`
    characters of that text (as `json.dumps` writes it, escapes and a cut string's closing quote
    not counted), so a schema asking for 10^9 strings of 10^9 letters costs what the answer
    can carry, not what it asks. Past the limit every value is null: that part of the text is
    never sent (the answer ends at its tokens first), and what comes before is the same as in the
    whole value (the same choices, in the same order), so a resumed job continues exactly."""

    def __init__(self, max_chars: float = math.inf) -> None:
        self.left = max_chars
        self.whole = True
        self._root: Any = None

    def instance(self, schema: Any, rng: random.Random) -> Any:
        self._root = schema
        return self._value(schema, rng, 0)

    def _spend(self, chars: int) -> None:
        self.left -= chars
        if self.left <= 0:
            self.whole = False

    def _value(self, schema: Any, rng: random.Random, depth: int) -> Any:
        if self.left <= 0:
            return None
        if depth > _MAX_DEPTH:
            raise InvalidPrompt("The schema nests too deep for the simulator.")
        if schema is True or schema == {}:
            return self._scalar(_words(rng, 2))
        if not isinstance(schema, dict):
            raise InvalidPrompt("The schema admits no value the simulator can build.")
        if "$ref" in schema:
            return self._value(_resolve(self._root, schema["$ref"]), rng, depth + 1)
        if "const" in schema:
            return self._scalar(schema["const"])
        if "enum" in schema:
            return self._scalar(rng.choice(schema["enum"]))
        if "allOf" in schema:
            return self._value(_all_of(schema, self._root), rng, depth + 1)
        if "oneOf" in schema:
            return self._value(schema["oneOf"][0], rng, depth + 1)
        if "anyOf" in schema:
            branches = schema["anyOf"]
            if depth >= _SHALLOW_DEPTH:
                branches = [b for b in branches if "$ref" not in b] or branches
            branch = dict(rng.choice(branches))
            for key, value in schema.items():  # siblings of anyOf (vLLM's `"type": "object"`) apply too
                if key != "anyOf":
                    branch.setdefault(key, value)
            return self._value(branch, rng, depth + 1)
        return self._typed(schema, rng, depth)

    def _typed(self, schema: dict[str, Any], rng: random.Random, depth: int) -> Any:
        """A value of the schema's `type` (one of them, if a list; guessed from its keywords if none)."""
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"] if depth >= _SHALLOW_DEPTH and "null" in kind else kind
            kind = rng.choice(kinds) if depth < _SHALLOW_DEPTH else ("null" if "null" in kind else kinds[0])
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
        if kind == "object":
            return self._object(schema, rng, depth)
        if kind == "array":
            return self._array(schema, rng, depth)
        if kind == "string":
            return self._string(schema, rng)
        if kind not in _SCALARS:
            raise InvalidPrompt(f"The simulator cannot build a value of type {kind!r}.")
        return self._scalar(_SCALARS[kind](schema, rng))

    def _scalar(self, value: Any) -> Any:
        self._spend(len(json.dumps(value, ensure_ascii=False)))
        return value

    def _object(self, schema: dict[str, Any], rng: random.Random, depth: int) -> dict[str, Any]:
        properties: dict[str, Any] = schema.get("properties", {})
        required = set(schema.get("required", []))
        chosen = {name for name in properties if name in required or (depth < _SHALLOW_DEPTH and rng.random() < 0.5)}
        missing = schema.get("minProperties", 0) - len(chosen)
        for name in properties:
            if missing <= 0:
                break
            if name not in chosen:
                chosen.add(name)
                missing -= 1
        self._spend(1)
        value: dict[str, Any] = {}
        for name in properties:
            if name in chosen and self.left > 0:
                self._spend(len(name) + (4 if not value else 6))  # `, "name": `
                value[name] = self._value(properties[name], rng, depth + 1)
        return value

    def _array(self, schema: dict[str, Any], rng: random.Random, depth: int) -> list[Any]:
        low = schema.get("minItems", 0)
        high = schema.get("maxItems", low + 3)
        size = low if depth >= _SHALLOW_DEPTH else rng.randint(low, max(low, min(high, low + 3)))
        prefix: list[Any] = schema.get("prefixItems", [])
        items = schema.get("items", {})
        unique = bool(schema.get("uniqueItems"))
        self._spend(1)
        values: list[Any] = []
        seen: set[str] = set()
        repeats = 0
        for index in range(size * 3 if unique else size):
            if len(values) == size or self.left <= 0 or repeats == _REPEATS:
                break
            left, whole = self.left, self.whole
            if values:
                self._spend(2)  # `, `
            value = self._value(prefix[index] if index < len(prefix) else items, rng, depth + 1)
            if not unique:
                values.append(value)
            elif (key := json.dumps(value, sort_keys=True)) not in seen:
                seen.add(key)
                values.append(value)
                repeats = 0
            else:  # a repeat is dropped: it takes no room in the answer
                self.left, self.whole = left, whole
                repeats += 1
        return values

    def _string(self, schema: dict[str, Any], rng: random.Random) -> str:
        fmt = schema.get("format")
        if fmt == "uuid":
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            self._spend(len(value) + 2)
            return value
        text = _FORMATS.get(fmt, "") if isinstance(fmt, str) else ""
        words = [text or _words(rng, rng.randint(1, 3))]
        length = len(words[0])
        # Up to minLength, as far as the answer can carry (a quote and the letters so far count).
        wanted = min(schema.get("minLength", 0), self.left - 1)
        while length < wanted:
            word = _words(rng, 1)
            words.append(word)
            length += 1 + len(word)
        text = " ".join(words)
        if "maxLength" in schema:
            text = text[: schema["maxLength"]]
        self._spend(1 + len(text))
        return text


def _resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        raise InvalidPrompt(f"The simulator resolves only references inside the schema, not {ref!r}.")
    node = root
    for part in ref[1:].lstrip("/").split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise InvalidPrompt(f"The schema's reference {ref!r} points nowhere.")
        node = node[part]
    return node


def _all_of(schema: dict[str, Any], root: Any) -> dict[str, Any]:
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema["allOf"]:
        part = _resolve(root, part["$ref"]) if isinstance(part, dict) and "$ref" in part else part
        for key, value in part.items():
            if key == "properties":
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required":
                merged["required"] = [*merged.get("required", []), *value]
            else:
                merged.setdefault(key, value)
    return merged


def _bounds(schema: dict[str, Any], step: float) -> tuple[float, float]:
    low = schema.get("minimum", -math.inf)
    high = schema.get("maximum", math.inf)
    if "exclusiveMinimum" in schema:
        low = max(low, schema["exclusiveMinimum"] + step)
    if "exclusiveMaximum" in schema:
        high = min(high, schema["exclusiveMaximum"] - step)
    if math.isinf(low):
        low = min(0, high - 100)
    if math.isinf(high):
        high = low + 100
    if high < low:
        raise InvalidPrompt("The schema's number bounds admit no value.")
    return low, high


def _integer(schema: dict[str, Any], rng: random.Random) -> int:
    low, high = _bounds(schema, 1)
    low, high = math.ceil(low), math.floor(high)
    step = schema.get("multipleOf", 1)
    if isinstance(step, int) and step > 1:
        first, last = math.ceil(low / step), math.floor(high / step)
        if first > last:
            raise InvalidPrompt("The schema's integer bounds admit no multiple of multipleOf.")
        return rng.randint(first, last) * step
    if high < low:
        raise InvalidPrompt("The schema's integer bounds admit no value.")
    return rng.randint(low, high)


def _number(schema: dict[str, Any], rng: random.Random) -> float:
    low, high = _bounds(schema, 0.01)
    value = round(rng.uniform(low, high), 2)
    return value if low <= value <= high else (low + high) / 2


def _boolean(schema: dict[str, Any], rng: random.Random) -> bool:
    del schema
    return rng.random() < 0.5


def _null(schema: dict[str, Any], rng: random.Random) -> None:
    del schema, rng


_SCALARS: dict[str, Any] = {"integer": _integer, "number": _number, "boolean": _boolean, "null": _null}


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def token_logprob(token: str, index: int, top: int) -> TokenLogprob:
    """A synthetic log probability for token `index`: the token the most likely (p in [0.4, 0.95]),
    `top - 1` other words after it, each half as likely as the one before."""
    digest = zlib.crc32(f"{index}|{token}".encode())
    chosen = 0.4 + 0.55 * (digest % 1000) / 1000
    logprob = math.log(chosen)
    encoded = list(token.encode())
    top_logprobs = [TopLogprob(token=token, logprob=logprob, bytes=encoded)] if top else []
    space = token[: len(token) - len(token.lstrip())]
    start = digest % len(_ALTERNATIVES)
    mass = 1.0 - chosen
    for offset in range(len(_ALTERNATIVES)):
        if len(top_logprobs) >= top:
            break
        other = space + _ALTERNATIVES[(start + offset) % len(_ALTERNATIVES)]
        if other == token:
            continue
        mass /= 2
        top_logprobs.append(TopLogprob(token=other, logprob=math.log(mass), bytes=list(other.encode())))
    return TokenLogprob(token=token, logprob=logprob, bytes=encoded, top_logprobs=top_logprobs)


def prompt_logprobs(prompt: str, top: int) -> tuple[TokenLogprob, ...]:
    """Synthetic log probabilities of the prompt's pieces (its words, with the space before each)."""
    return tuple(token_logprob(piece, -1 - i, top) for i, piece in enumerate(re.findall(r"\s*\S+|\s+", prompt)))


def block_keys(tokens: Sequence[str]) -> list[bytes]:
    """The keys of the full `BLOCK_TOKENS`-token blocks of `tokens`: each the hash of its tokens and
    of the previous block's key, so a key stands for the whole prefix up to its block's end."""
    keys: list[bytes] = []
    key = b""
    for end in range(BLOCK_TOKENS, len(tokens) + 1, BLOCK_TOKENS):
        key = hashlib.blake2b(key + "\0".join(tokens[end - BLOCK_TOKENS : end]).encode(), digest_size=16).digest()
        keys.append(key)
    return keys


def token_id(word: str) -> int:
    """The id the simulator's KV-cache events give a word (its tokens are its prompt's words)."""
    return zlib.crc32(word.encode())


class PrefixCache:
    """An LRU of `capacity` block keys (0: nothing is ever cached), a prompt's blocks used tail
    first, as vLLM frees them: its last blocks are evicted first, so a prefix is never held
    without its start. With `events`, each block stored and each block evicted is published as
    vLLM publishes them (`kv_events.py`): one batch per insertion."""

    def __init__(self, capacity: int, events: SimKvEvents | None = None) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._events = events

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many of the leading `keys` are cached (those are touched as used)."""
        hits = 0
        for key in keys:
            if key not in self._blocks:
                break
            hits += 1
        for key in reversed(keys[:hits]):
            self._blocks.move_to_end(key)
        return hits

    def insert(self, keys: Sequence[bytes], tokens: Sequence[str] = ()) -> None:
        """Cache `keys` (the blocks of `tokens`) as the most recently used, evicting the least
        recently used past capacity."""
        if self.capacity == 0:
            return
        events: list[KvEvent] = []
        parent: bytes | None = None
        for index, key in enumerate(keys):
            if key not in self._blocks and self._events is not None:
                words = tokens[index * BLOCK_TOKENS : (index + 1) * BLOCK_TOKENS]
                events.append(BlockStored([key], parent, [token_id(w) for w in words], BLOCK_TOKENS))
            self._blocks[key] = None
            parent = key
        for key in reversed(keys):
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            evicted, _ = self._blocks.popitem(last=False)
            if self._events is not None:
                events.append(BlockRemoved([evicted]))
        if self._events is not None:
            self._events.publish(events)


class SimEngine(Engine):
    """Deterministic word generator with configurable latency and concurrency."""

    name = "sim"

    supports: ClassVar[frozenset[Capability]] = frozenset(
        {"tools", "response_format", "logprobs", "seed", "stop", "echo"}
    )

    def __init__(
        self,
        *,
        model_name: str,
        ttft_ms: float,
        itl_ms: float,
        max_seqs: int,
        context_tokens: int,
        fail_after_s: float = 0.0,
        kv_blocks: int = 0,
        prefill_us_per_token: float = 0.0,
        adapters: Iterable[str] = (),
        kv_events: SimKvEvents | None = None,
    ) -> None:
        self.model_name = model_name
        self.max_seqs = max_seqs
        self.context_tokens = context_tokens
        self.adapters = frozenset(adapters)
        self._ttft_s = ttft_ms / 1000
        self._itl_s = itl_ms / 1000
        self._running_ids: set[str] = set()
        self._aborted: set[str] = set()
        self._running = False
        self._fail_after_s = fail_after_s
        self._started_at = 0.0
        self._kv_events = kv_events
        self.prefix_cache = PrefixCache(kv_blocks, kv_events)
        self.kv_block_size = BLOCK_TOKENS if kv_events is not None else 0
        self._prefill_s_per_token = prefill_us_per_token / 1_000_000

    async def start(self) -> None:
        self._running = True
        self._started_at = time.monotonic()

    async def stop(self) -> None:
        self._running = False

    async def abort(self, request_id: str) -> None:
        if request_id in self._running_ids:
            self._aborted.add(request_id)

    reports_kv_cache = True

    def kv_events(self) -> KvEventSource | None:
        return self._kv_events

    def kv_cache_usage(self) -> float | None:
        # The simulator's "cache" holds one slot per running sequence.
        return len(self._running_ids) / self.max_seqs

    async def check_health(self) -> None:
        if self._fail_after_s and time.monotonic() - self._started_at > self._fail_after_s:
            raise EngineError("simulated engine failure (AXON_SIM_FAIL_AFTER_S)")

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return max(1, len(prompt_text(request).split()))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineOutput]:
        prompt = prompt_text(request)
        words = prompt.split()
        prompt_tokens = max(1, len(words))
        # At least the prompt's last token is computed, as in vLLM: only blocks before it can hit.
        cached = self.prefix_cache.match(block_keys(words[: prompt_tokens - 1])) * BLOCK_TOKENS
        if self.prompt_observer is not None and routed(request.messages, request.prompt):
            ends = [m.end() for m in re.finditer(r"\S+", prompt)]
            self.prompt_observer(request, RenderedPrompt(prompt, [token_id(w) for w in words], ends))
        self.prefix_cache.insert(block_keys(words), words)
        ttft_s = self._ttft_s + (prompt_tokens - cached) * self._prefill_s_per_token
        sampling = request.sampling
        offset = request.resume.completion_tokens if request.resume else 0
        json_answer = await _json_answer(request, prompt, offset + sampling.max_tokens)
        pieces = None if json_answer is None else json_answer.pieces
        # A JSON answer built whole ends `stop` at its last piece; one cut at the tokens, `length`.
        last = len(json_answer.pieces) - 1 if json_answer is not None and json_answer.whole else None
        stops = StopMatcher(sampling.stop)
        started = time.monotonic()
        total = sampling.max_tokens if pieces is None else min(sampling.max_tokens, len(pieces) - offset)
        top = request.logprobs
        echoed = prompt_logprobs(prompt, top) if request.echo and top is not None else ()
        if total <= 0:  # a resumed answer that was complete
            reason: FinishReason = "stop" if last is not None else "length"
            yield EngineOutput("", 0, prompt_tokens, 0, finish_reason=reason, cached_tokens=cached)
            return
        self._running_ids.add(request.request_id)
        answer = [request.resume.text] if request.resume else []
        voice = prompt if request.adapter is None else f"{request.adapter}|{prompt}"
        try:
            for count in range(total):
                due = started + ttft_s + count * self._itl_s
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                elif count % _TOKENS_PER_STEP == 0:
                    await asyncio.sleep(0)  # tokens already due come in steps, like a batch engine's
                if request.request_id in self._aborted:
                    yield EngineOutput("", 0, prompt_tokens, count, finish_reason="cancelled", cached_tokens=cached)
                    return
                index = offset + count
                if pieces is None:
                    word = sim_word(voice, sampling.seed, index)
                    token = word if index == 0 else " " + word
                else:
                    token = pieces[index]
                text = stops.feed(token)
                logprobs = (token_logprob(token, index, top),) if top is not None else ()
                first = echoed if count == 0 else ()
                if stops.stopped:
                    answer.append(text)
                    yield EngineOutput(
                        text,
                        1,
                        prompt_tokens,
                        count + 1,
                        "stop",
                        logprobs=logprobs,
                        prompt_logprobs=first,
                        cached_tokens=cached,
                        stop_sequence=stops.matched,
                    )
                    return
                finish: FinishReason | None = None
                if count == total - 1:
                    text += stops.flush()
                    finish = "stop" if index == last else "length"
                answer.append(text)
                yield EngineOutput(
                    text,
                    1,
                    prompt_tokens,
                    count + 1,
                    finish,
                    logprobs=logprobs,
                    prompt_logprobs=first,
                    cached_tokens=cached,
                )
        finally:
            self._running_ids.discard(request.request_id)
            self._aborted.discard(request.request_id)
            marker = [_ANSWER_MARKER] if request.messages is not None else []
            whole = [*words, *marker, *"".join(answer).split()]
            self.prefix_cache.insert(block_keys(whole), whole)
