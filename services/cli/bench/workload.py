"""`axon bench`'s workload: the run's configuration, prompts (a JSONL file or synthetic), the
request bodies serialised up front, and the Poisson arrival schedule."""

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

Endpoint = Literal["chat", "completions", "messages"]
# Each endpoint's path under the base URL (`messages`: Anthropic's Messages API).
_PATHS: dict[str, str] = {"chat": "/chat/completions", "completions": "/completions", "messages": "/messages"}

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_SYNTHETIC_REQUESTS = 100
# Common English words: most tokenizers spend about one token on each.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part over new sound take only little work know place"
).split()


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything that shapes one benchmark run (what the JSON's `config` records)."""

    base_url: str
    model: str
    endpoint: Endpoint = "chat"
    num_requests: int = DEFAULT_SYNTHETIC_REQUESTS
    max_concurrency: int | None = None
    request_rate: float = math.inf
    input_len: int = 128
    output_len: int = 128
    prompts_file: str | None = None
    stream: bool = True
    seed: int = 0
    temperature: float | None = 0.0
    timeout_s: float = 300.0
    warmup: int = 0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + _PATHS[self.endpoint]


@dataclass(frozen=True, slots=True)
class PromptEntry:
    """One line of a prompts file (or one synthetic prompt): a prompt or chat messages, and any
    other request fields of its own (`tools`, `response_format`, ...), sent as they are."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)


# Request fields the bench sets itself: a prompts file line may not.
_BENCH_FIELDS = frozenset({"model", "stream", "stream_options"})


class PromptsFileError(ValueError):
    """The prompts file cannot be used; the message names the line."""


def load_prompts_file(path: str | Path) -> list[PromptEntry]:
    """Read a JSONL prompts file: one `{"prompt": ...}` or `{"messages": [...]}` object per line.

    Each object may carry `max_tokens`, and any other request field (`tools`, `tool_choice`,
    `response_format`, `temperature`, ...), which its requests send as they are. Blank lines are
    skipped.

    Raises:
        PromptsFileError: the file is empty, a line is not JSON, or a line has neither field.
    """
    entries: list[PromptEntry] = []
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise PromptsFileError(f"{path}:{number}: not JSON ({exc})") from None
            entries.append(_prompt_entry(obj, where=f"{path}:{number}"))
    if not entries:
        raise PromptsFileError(f"{path}: no prompts")
    return entries


def _prompt_entry(obj: Any, *, where: str) -> PromptEntry:
    if not isinstance(obj, dict):
        raise PromptsFileError(f"{where}: expected a JSON object")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise PromptsFileError(f"{where}: max_tokens must be a positive integer")
    fields = {k: v for k, v in obj.items() if k not in ("prompt", "messages", "max_tokens")}
    if reserved := sorted(_BENCH_FIELDS.intersection(fields)):
        raise PromptsFileError(f"{where}: {', '.join(reserved)} is set by the bench, not by a prompt")
    messages = obj.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise PromptsFileError(f"{where}: messages must be a non-empty list of objects")
        return PromptEntry(messages=messages, max_tokens=max_tokens, fields=fields)
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        raise PromptsFileError(f'{where}: needs "prompt" (a string) or "messages" (a list)')
    return PromptEntry(prompt=prompt, max_tokens=max_tokens, fields=fields)


def synthetic_prompts(count: int, *, input_len: int, seed: int) -> list[PromptEntry]:
    """`count` distinct prompts of about `input_len` words each, the same for the same seed."""
    rng = random.Random(f"{seed}:prompts")
    body_len = max(input_len - 2, 0)
    return [PromptEntry(prompt=f"Request {i}: " + " ".join(rng.choices(_WORDS, k=body_len))) for i in range(count)]


def build_bodies(config: BenchConfig, entries: Sequence[PromptEntry], count: int) -> list[bytes]:
    """Serialise `count` request bodies up front, cycling through `entries`.

    Raises:
        PromptsFileError: a chat-messages entry is used against the completions endpoint.
    """
    common: dict[str, Any] = {"model": config.model, "stream": config.stream}
    if config.temperature is not None:
        common["temperature"] = config.temperature
    if config.stream and config.endpoint != "messages":  # a Messages stream always ends with its usage
        common["stream_options"] = {"include_usage": True}
    bodies = []
    for i in range(count):
        entry = entries[i % len(entries)]
        body = {**common, **entry.fields, "max_tokens": entry.max_tokens or config.output_len}
        if config.endpoint in ("chat", "messages"):
            body["messages"] = entry.messages or [{"role": "user", "content": entry.prompt}]
        elif entry.messages is not None:
            raise PromptsFileError('"messages" entries need --endpoint chat or messages')
        else:
            body["prompt"] = entry.prompt
        bodies.append(orjson.dumps(body))
    return bodies


def arrival_offsets_s(count: int, *, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: a Poisson process of `request_rate` per second.

    The first request goes at 0; the gaps are exponential with mean `1 / request_rate`.
    An infinite rate sends everything at once.
    """
    if math.isinf(request_rate):
        return [0.0] * count
    if request_rate <= 0:
        raise ValueError("request_rate must be positive")
    rng = random.Random(f"{seed}:arrivals")
    offsets, now_s = [], 0.0
    for _ in range(count):
        offsets.append(now_s)
        now_s += rng.expovariate(request_rate)
    return offsets
