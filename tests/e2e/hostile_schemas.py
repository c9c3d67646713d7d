"""Issue 29's hostile schemas, for the e2e modules of each engine (simulator: test_hostile_clients.py,
CPU: test_real_model.py, vLLM: test_vllm_engine.py): each must be answered 400 or within the
request's max_tokens while the worker's /health keeps answering (`HealthWatch`).

The first ones no answer within max_tokens can satisfy: the session manager refuses them before any
job is queued (shared/schema_bounds.py). The others are admitted, and each engine must generate
them within the step budget or refuse them: the simulator builds a value only as far as max_tokens
reaches, the CPU and vLLM engines compile a new schema in a probe killed past
AXON_GRAMMAR_COMPILE_TIMEOUT_S (`TOO_COMPLEX`, which they refuse with 400)."""

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.cli.launcher import Service

# The schema that wedged a simulator worker, and each one it was redelivered to.
ISSUE_29 = {"type": "array", "minItems": 1_000_000_000, "items": {"type": "string", "minLength": 1_000_000_000}}


def _chain_of_choices(levels: int) -> dict[str, Any]:
    """2^levels paths through references: each level a value of the next, or an array of them."""
    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}]}
        for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _deep_any_of(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"anyOf": [{"type": "boolean"}, {"type": "object", "properties": {"x": schema}, "required": ["x"]}]}
    return schema


@dataclass(frozen=True)
class Hostile:
    name: str
    # The request's constraint: `response_format`, or `tools` with `tool_choice`.
    fields: dict[str, Any]
    max_tokens: int
    # None: admitted, answered within max_tokens; else refused at admission, 400 naming this param.
    refused: str | None = None
    # The engines (`sim`, `transformers`, `vllm`) that refuse it themselves: 400 naming the
    # constraint's param (`response_format`).
    refused_by: frozenset[str] = frozenset()


def _format(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "hostile", "schema": schema}}}


def _named_tool(parameters: Any) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "hostile", "parameters": parameters}}
    return {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "hostile"}}}


# Refused at admission: no answer within max_tokens (or at all) satisfies them.
REFUSED = [
    Hostile("issue 29: 1e9 strings of 1e9 characters", _format(ISSUE_29), 24, "response_format"),
    Hostile(
        "issue 29 as a forced tool call's arguments",
        _named_tool({"type": "object", "properties": {"items": ISSUE_29}, "required": ["items"]}),
        24,
        "tools",
    ),
    Hostile(
        "a string of 1e6 characters in 24 tokens",
        _format({"type": "string", "minLength": 1_000_000}),
        24,
        "response_format",
    ),
    Hostile(
        "nested minItems 1000 x 1000 x 1000",
        _format(
            {
                "type": "array",
                "minItems": 1000,
                "items": {"type": "array", "minItems": 1000, "items": {"type": "array", "minItems": 1000}},
            }
        ),
        4096,
        "response_format",
    ),
    Hostile("minProperties 1e9", _format({"type": "object", "minProperties": 1_000_000_000}), 4096, "response_format"),
    Hostile(
        "1,500 required properties in 64 tokens",
        _format(
            {
                "type": "object",
                "properties": {f"p{i}": {"type": "integer"} for i in range(1500)},
                "required": [f"p{i}" for i in range(1500)],
            }
        ),
        64,
        "response_format",
    ),
    Hostile(
        "a $ref cycle",
        _format({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        4096,
        "response_format",
    ),
    Hostile(
        "a property that requires the schema itself",
        _format({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        4096,
        "response_format",
    ),
]

# 40 strings with distinct length bounds in the millions: xgrammar compiles each bound apart, about
# 3 s each on the 2-core development machine (vLLM's backend took 52 s for the lot).
TOO_COMPLEX = Hostile(
    "40 distinct large maxLength bounds",
    _format(
        {
            "type": "object",
            "properties": {
                f"p{i}": {"type": "string", "minLength": i, "maxLength": 100_000_000 + i} for i in range(40)
            },
        }
    ),
    16,
    refused_by=frozenset({"transformers", "vllm"}),
)

# Admitted (the bound counts an unknown reference as one character), but no engine can build it:
# each refuses it with a 400 of its own, and the job is acked once.
NOWHERE = Hostile(
    "a $ref that points nowhere",
    _format({"type": "array", "items": {"$ref": "#/$defs/missing"}, "minItems": 1}),
    16,
    refused_by=frozenset({"sim", "transformers", "vllm"}),
)

# Admitted: each engine must answer them within max_tokens.
ADMITTED = [
    Hostile(
        "1e9 characters or an integer",
        _format({"anyOf": [{"type": "string", "minLength": 1_000_000_000}, {"type": "integer"}]}),
        32,
    ),
    # vLLM refuses a schema nested past 64 levels.
    Hostile("anyOf nested 40 deep", _format(_deep_any_of(40)), 32, refused_by=frozenset({"vllm"})),
    Hostile("2^40 paths through $ref", _format(_chain_of_choices(40)), 32),
    Hostile(
        "an enum of 4,500 strings", _format({"type": "string", "enum": [f"value-{i:05d}" for i in range(4500)]}), 16
    ),
    Hostile("a catastrophically backtracking pattern", _format({"type": "string", "pattern": "^(a+)+$"}), 16),
    Hostile("nested bounded repetitions", _format({"type": "string", "pattern": "^((a{1,100}){1,100}){1,100}$"}), 16),
    Hostile(
        "a recursive tree",
        _format(
            {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
                "required": ["v"],
            }
        ),
        32,
    ),
]


class Sender:
    """Sends each case to a gateway for a model, over one kept-alive connection."""

    def __init__(self, gateway: Service, auth: dict[str, str], model: str) -> None:
        self._client = httpx.Client(base_url=gateway.url, headers=auth, timeout=120)
        self._model = model

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *_: object) -> None:
        self._client.close()

    def send(self, case: Hostile, **extra: Any) -> httpx.Response:
        body = {
            "model": self._model,
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "max_tokens": case.max_tokens,
            **case.fields,
            **extra,
        }
        return self._client.post("/v1/chat/completions", json=body)

    def send_together(self, cases: list[Hostile], **extra: Any) -> list[httpx.Response]:
        """Each case at once (an engine batches them: on the CPU a case takes seconds)."""
        with ThreadPoolExecutor(len(cases)) as pool:
            return list(pool.map(lambda case: self.send(case, **extra), cases))


def check(response: httpx.Response, case: Hostile, engine: str) -> dict[str, Any]:
    """The answer is what the case expects of `engine`: a 400 `invalid_request_error` naming
    `case.refused` (admission) or its constraint (an engine's refusal), else a 200 within
    `max_tokens`."""
    param = case.refused or ("response_format" if engine in case.refused_by else None)
    payload: dict[str, Any] = response.json()
    if param is not None:
        assert response.status_code == 400, (case.name, response.text)
        assert (payload["error"]["type"], payload["error"]["param"]) == ("invalid_request_error", param), case.name
    else:
        assert response.status_code == 200, (case.name, response.text)
        assert payload["usage"]["completion_tokens"] <= case.max_tokens, case.name
        assert payload["choices"][0]["finish_reason"] in {"stop", "length"}, case.name
    return payload


@dataclass
class HealthWatch:
    """A worker's /health, asked every 0.2 s on a thread: each answer's status and time."""

    worker: Service
    answers: list[tuple[int | str, float]] = field(default_factory=list)

    @property
    def slowest_s(self) -> float:
        return max(seconds for _, seconds in self.answers)

    def assert_answered_throughout(self) -> None:
        """Every ask was answered 200 within the 2 s it was given (a wedged worker answered none)."""
        assert len(self.answers) >= 2, self.answers
        assert all(status == 200 for status, _ in self.answers), [a for a in self.answers if a[0] != 200]


@contextmanager
def health_watched(worker: Service) -> Iterator[HealthWatch]:
    watch = HealthWatch(worker)
    stop = threading.Event()

    def ask() -> None:
        with httpx.Client(timeout=2) as client:
            while not stop.is_set():
                began = time.monotonic()
                try:
                    status: int | str = client.get(f"{worker.url}/health").status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                watch.answers.append((status, time.monotonic() - began))
                stop.wait(0.2)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    try:
        yield watch
    finally:
        stop.set()
        asker.join()
