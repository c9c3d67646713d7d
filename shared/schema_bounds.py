"""The fewest tokens an answer constrained by a JSON Schema can take, and the admission check that a
request's `max_tokens` leaves room for it.

A schema can ask for more than any answer can hold: `{"type": "array", "minItems": 1000000000,
"items": {"type": "string", "minLength": 1000000000}}` (issue 29) has no valid instance shorter
than 10^18 characters. Such a request is refused before a job is queued (`check_answer_fits`, a
400 naming `response_format`, or `tools` for a required or named tool call's schema) instead of
reaching an engine that would build or decode toward it.

`min_chars` is the length of the shortest JSON text valid against a schema, or a lower bound of it
(it never says more than the truth, so a refusal is always right):

- a string takes its quotes and `minLength` characters; an array its brackets, its `minItems`
  items (the `prefixItems` first, then `items`) and the commas between them; an object its braces,
  each `required` property (its quoted name, a colon and its value) and `minProperties` beyond
  them (at least `"":0` each), with commas; `const` and `enum` their shortest JSON text; a
  number 1 character, `true`, `false` and `null` 4; no `type`: 1 (a number is valid);
- `anyOf` and `oneOf` take their cheapest branch, `allOf` its dearest part (with the schema's own
  keywords, which apply too, and its `type` carried into each); a `$ref` its target inside the
  document (its siblings ignored, as draft 7 has it; a reference outside: 1); keywords that only
  narrow further (`pattern`, `format`, `not`, `if`, bounds of numbers, ...) are not counted;
- a schema nothing can satisfy (`false`, an empty `enum`, `maxLength` below `minLength`, a
  required property `additionalProperties: false` forbids, references that loop with no way out
  such as a property that requires the schema itself) is `math.inf`.

It is computed over the schema as a graph (one node per subschema, references as edges) by Knuth's
generalisation of Dijkstra's algorithm (each rule's length is at least each of its parts', so
nodes are settled cheapest first, each once), in time linear in the schema's size (times a log),
whatever its references.

Tokens: `min_tokens` counts one token per `MAX_TOKEN_CHARS` (128) characters, more than a token
holds (the bundled SmolLM2's longest token is 81 characters), so a refusal holds for any model
whose tokens are no longer: a schema is refused only when no answer within `max_tokens` could
satisfy it. What is admitted may still be cut at `max_tokens` (finish reason `length`), as any
answer; the engines generate it within that budget (the simulator builds no more of a value than
`max_tokens` can carry).
"""

import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Any, Final
from urllib.parse import unquote

import orjson

from shared.errors import InvalidRequest
from shared.openai_requests import ChatCompletionRequest, CompletionRequest, NamedToolChoiceParam

# Characters one token may hold at most, for the bound (see the module's docstring).
MAX_TOKEN_CHARS: Final = 128

# The JSON types a value may take (a schema's `type`, and its parents').
_Types = frozenset[str]
_ALL_TYPES: Final = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})
# The shortest value of each type: `null`, `true`, `0`, `""`, `[]`, `{}`.
_CHEAPEST: Final = {"null": 4, "boolean": 4, "integer": 1, "number": 1, "string": 2, "array": 2, "object": 2}
# `{"name":` ... `,"parameters":` ... `}`, around each call of a required tool choice, in `[` `]`.
_CALL_CHARS = len('{"name":,"parameters":}')


def min_chars(schema: Any) -> float:
    """The length of the shortest compact JSON text valid against `schema`, or a lower bound of it;
    `math.inf` if no finite text is valid (see the module's docstring)."""
    return _Graph(schema).shortest()


def min_tokens(chars: float) -> float:
    """The fewest tokens `chars` characters of answer take (`math.inf` stays infinite)."""
    return chars if chars == math.inf else -(-int(chars) // MAX_TOKEN_CHARS)


def check_fits(chars: float, max_tokens: int, *, param: str, what: str) -> None:
    """Refuse an answer whose shortest valid text is `chars` characters if `max_tokens` cannot hold it.

    Raises:
        InvalidRequest: it cannot (`param` names the field; `what` says whose schema it is).
    """
    if chars == math.inf:
        raise InvalidRequest(
            f"{what} admits no JSON value of finite length (a part of it nothing can satisfy, or "
            "references that loop with no way out), so no answer can follow it.",
            param=param,
        )
    tokens = min_tokens(chars)
    if tokens > max_tokens:
        raise InvalidRequest(
            f"{what} needs an answer of at least {int(chars)} characters, at least {int(tokens)} tokens "
            f"(counting {MAX_TOKEN_CHARS} characters a token at most), more than max_tokens ({max_tokens}).",
            param=param,
        )


def check_answer_fits(request: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> None:
    """Refuse a chat request whose constrained answer cannot fit in `max_tokens`: under a named
    `tool_choice` a call of that function (its arguments), under `required` one call of the
    cheapest tool (`[{"name": …, "parameters": …}]`), either winning over `response_format` as on
    the worker; else a `json_schema` `response_format`'s value.

    Raises:
        InvalidRequest: it cannot (`param`: `tools` or `response_format`).
    """
    if not isinstance(request, ChatCompletionRequest):
        return
    choice = request.tool_choice
    tools = {
        tool.function.name: _NO_PARAMETERS if (p := tool.function.parameters) is None else p
        for tool in request.tools or ()
    }
    if tools and isinstance(choice, NamedToolChoiceParam) and choice.function.name in tools:
        name = choice.function.name
        check_fits(min_chars(tools[name]), max_tokens, param="tools", what=f"A call of the function '{name}'")
    elif tools and choice == "required":
        calls = (2 + _CALL_CHARS + _json_chars(name) + min_chars(params) for name, params in tools.items())
        check_fits(min(calls), max_tokens, param="tools", what="A call of any of the tools")
    elif (fmt := request.response_format) is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        what = "The response_format's JSON schema"
        check_fits(min_chars(fmt.json_schema.schema_), max_tokens, param="response_format", what=what)


# A function declared without `parameters` takes none (OpenAI's rule): its arguments are an object.
_NO_PARAMETERS: Final[dict[str, Any]] = {"type": "object", "properties": {}}


class _Graph:
    """A schema as productions: node `n`'s length is the least of its productions', a production's
    is its constant plus the weighted sum of its parts' lengths (or the largest of them and the
    constant, for `allOf`). A node with no production, or whose productions all wait on such
    nodes, has no finite length.

    Each subschema (a dict of the document, by identity) is one node, however many references and
    parents reach it; once per set of types its parent allows, as a branch of `anyOf`, `oneOf` or
    `allOf` (or a reference) takes its parent's `type` (`{"type": "object", "anyOf":
    [{"required": ["a"]}, ...]}`: each branch is an object)."""

    def __init__(self, root: Any) -> None:
        self._root = root
        self._owner: list[int] = []
        self._is_max: list[bool] = []
        self._const: list[int] = []
        self._args: list[Sequence[tuple[int, int]]] = []
        self._nodes = 0
        self._of: dict[tuple[int, _Types], int] = {}
        self._leaves: dict[int, int] = {}
        # Referenced subschemas not built yet: built after the schema around them, never by
        # recursion (a chain of references is as long as the document allows).
        self._pending: list[tuple[int, dict[str, Any], _Types]] = []

    def shortest(self) -> float:
        start = self._node(self._root, _ALL_TYPES)
        while self._pending:
            self._build(*self._pending.pop())
        return self._solve(start)

    # Building ---------------------------------------------------------------------------------

    def _new(self) -> int:
        self._nodes += 1
        return self._nodes - 1

    def _rule(self, owner: int, const: int, parts: Iterable[tuple[int, int]] = (), *, is_max: bool = False) -> None:
        merged: dict[int, int] = {}
        for weight, node in parts:
            merged[node] = merged.get(node, 0) + weight
        self._owner.append(owner)
        self._is_max.append(is_max)
        self._const.append(const)
        self._args.append([(weight, node) for node, weight in merged.items()])

    def _leaf(self, chars: float) -> int:
        """A node of fixed length (`math.inf`: one with no production)."""
        if chars == math.inf:
            return self._new()
        node = self._leaves.get(int(chars))
        if node is None:
            node = self._leaves[int(chars)] = self._new()
            self._rule(node, int(chars))
        return node

    def _node(self, schema: Any, types: _Types) -> int:
        """The node of the subschema `schema`, its values of `types` only (built on first use)."""
        if schema is False:
            return self._new()
        if not isinstance(schema, dict) or not schema:
            return self._leaf(min((_CHEAPEST[t] for t in types), default=math.inf))
        node = self._of.get((id(schema), types))
        if node is None:
            node = self._of[id(schema), types] = self._new()
            self._build(node, schema, types)
        return node

    def _ref(self, ref: str, types: _Types) -> int:
        if not ref.startswith("#"):
            return self._leaf(1)  # outside the document: unknown
        target = _resolve(self._root, ref[1:])
        if target is _NOWHERE:
            return self._leaf(1)  # an engine refuses a reference that points nowhere
        if not isinstance(target, dict) or not target:
            return self._node(target, types)
        node = self._of.get((id(target), types))
        if node is None:
            node = self._of[id(target), types] = self._new()
            self._pending.append((node, target, types))
        return node

    def _build(self, node: int, schema: dict[str, Any], types: _Types) -> None:
        ref = schema.get("$ref")
        if isinstance(ref, str):  # its siblings are ignored (as draft 7 has it, and counted less)
            self._rule(node, 0, [(1, self._ref(ref, types))])
            return
        kind = schema.get("type")
        if isinstance(kind, str | list):
            types = types & frozenset([kind] if isinstance(kind, str) else kind)
        any_of, one_of, all_of = schema.get("anyOf"), schema.get("oneOf"), schema.get("allOf")
        if not (any_of or one_of or all_of):
            self._own_keywords(node, schema, types)
            return
        own = self._new()
        self._own_keywords(own, schema, types)
        parts = [own]
        for branches in (any_of, one_of):
            if isinstance(branches, list) and branches:
                choice = self._new()
                for branch in branches:
                    self._rule(choice, 0, [(1, self._node(branch, types))])
                parts.append(choice)
        if isinstance(all_of, list):
            parts.extend(self._node(part, types) for part in all_of)
        self._rule(node, 0, [(1, part) for part in parts], is_max=True)

    def _own_keywords(self, node: int, schema: dict[str, Any], types: _Types) -> None:
        """The rules of what `schema`'s own keywords (not its combinators) ask of a value of `types`."""
        if "const" in schema:
            self._rule(node, _json_chars(schema["const"]))
            return
        enum = schema.get("enum")
        if isinstance(enum, list):
            if enum:
                self._rule(node, min(_json_chars(v) for v in enum))
            return
        if "integer" in types or "number" in types:
            self._rule(node, 1)
            return
        for kind in types:
            if kind in ("null", "boolean"):
                self._rule(node, 4)
            elif kind == "string":
                self._string(node, schema)
            elif kind == "array":
                self._array(node, schema)
            elif kind == "object":
                self._object(node, schema)

    def _string(self, node: int, schema: dict[str, Any]) -> None:
        low = _count(schema.get("minLength"), 0)
        if low <= _count(schema.get("maxLength"), low):
            self._rule(node, 2 + low)

    def _array(self, node: int, schema: dict[str, Any]) -> None:
        low = _count(schema.get("minItems"), 0)
        if low > _count(schema.get("maxItems"), low):
            return
        items = schema.get("items", True)
        prefix, rest = schema.get("prefixItems"), items
        if isinstance(items, list):  # draft 4 to 2019-09: `items` as a tuple, then `additionalItems`
            prefix, rest = items, schema.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        head = min(low, len(prefix))
        chars = 2 + max(0, low - 1)
        parts: list[tuple[int, int]] = []
        for count, item in [*((1, prefix[i]) for i in range(head)), *([(low - head, rest)] if low > head else [])]:
            fixed = _fixed_length(item)
            if fixed is None:
                parts.append((count, self._node(item, _ALL_TYPES)))
            else:
                chars += count * fixed
        self._rule(node, chars, parts)

    def _object(self, node: int, schema: dict[str, Any]) -> None:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        names = list(dict.fromkeys(n for n in required if isinstance(n, str))) if isinstance(required, list) else []
        extra = schema.get("additionalProperties", True)
        patterned = isinstance(schema.get("patternProperties"), dict) and bool(schema["patternProperties"])
        closed = extra is False and not patterned
        chars = 2
        parts: list[tuple[int, int]] = []
        for name in names:
            if name in properties:
                value = properties[name]
            elif closed:
                return  # required, and forbidden
            else:
                value = True if patterned else extra  # a pattern's schema: not counted
            chars += _json_chars(name) + 1
            fixed = _fixed_length(value)
            if fixed is None:
                parts.append((1, self._node(value, _ALL_TYPES)))
            else:
                chars += fixed
        more = _count(schema.get("minProperties"), 0) - len(names)
        if more > 0:
            if closed:
                others = sorted(_json_chars(n) for n in properties if n not in names)
                if more > len(others):
                    return  # more properties than the schema allows
                chars += sum(others[:more]) + 2 * more  # each with a colon and a value
            else:
                chars += 4 * more  # `"":0` at least
        self._rule(node, chars + max(0, len(names) + max(0, more) - 1), parts)

    # Solving ----------------------------------------------------------------------------------

    def _solve(self, start: int) -> float:
        """Knuth's algorithm: settle nodes cheapest first; a production is ready once its parts
        are settled. Stops once `start` is settled."""
        uses: list[list[int]] = [[] for _ in range(self._nodes)]
        waiting: list[int] = []
        ready: list[tuple[int, int]] = []
        for rule, args in enumerate(self._args):
            waiting.append(len(args))
            for _, part in args:
                uses[part].append(rule)
            if not args:
                ready.append((self._const[rule], self._owner[rule]))
        heapq.heapify(ready)
        length: list[int | None] = [None] * self._nodes
        while ready:
            chars, node = heapq.heappop(ready)
            if length[node] is not None:
                continue
            length[node] = chars
            if node == start:
                return chars
            for rule in uses[node]:
                waiting[rule] -= 1
                if waiting[rule] == 0:
                    heapq.heappush(ready, (self._value(rule, length), self._owner[rule]))
        return math.inf

    def _value(self, rule: int, length: list[int | None]) -> int:
        if self._is_max[rule]:  # a part named twice (`allOf` of one schema twice) counts once
            return max([self._const[rule], *(length[part] or 0 for _, part in self._args[rule])])
        return self._const[rule] + sum(weight * (length[part] or 0) for weight, part in self._args[rule])


_NOWHERE = object()


def _fixed_length(schema: Any) -> int | None:
    """The shortest length of a leaf schema, at once, without a node: `true`, `{}`, or one with
    neither references nor combinators whose values are a `const`, an `enum`, numbers, or
    satisfiable strings, booleans or nulls (most properties of most schemas). None: anything else."""
    if schema is True:
        return 1
    if not isinstance(schema, dict) or "$ref" in schema or "anyOf" in schema or "oneOf" in schema or "allOf" in schema:
        return None
    if "const" in schema:
        return _json_chars(schema["const"])
    if "enum" in schema:
        enum = schema["enum"]
        return min(_json_chars(v) for v in enum) if isinstance(enum, list) and enum else None
    kind = schema.get("type", "integer")
    if kind in ("integer", "number"):
        return 1
    if kind in ("null", "boolean"):
        return 4
    if kind == "string":
        low = _count(schema.get("minLength"), 0)
        return 2 + low if low <= _count(schema.get("maxLength"), low) else None
    return None


def _resolve(root: Any, pointer: str) -> Any:
    """The value at JSON pointer `pointer` (a reference's fragment) in `root`, or `_NOWHERE` (also
    for a fragment that is an anchor's name, not a pointer)."""
    if pointer and not pointer.startswith("/"):
        return _NOWHERE
    node = root
    for part in (unquote(p).replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _NOWHERE
    return node


def _json_chars(value: Any) -> int:
    """The length of `value` as compact JSON (1 for what orjson cannot write: an integer beyond
    64 bits, which the request's check refuses anyway)."""
    try:
        return len(orjson.dumps(value))
    except TypeError:
        return 1


def _count(value: Any, default: int) -> int:
    """A non-negative integer keyword (`minItems`, ...), `default` when absent or not one."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return default
    return value if isinstance(value, int) else int(value) if math.isfinite(value) else default
