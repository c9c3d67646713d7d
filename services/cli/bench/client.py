"""`axon bench`: a load generator for any OpenAI-compatible server, in the spirit of `vllm bench serve`.

It sends `--num-requests` chat or text completions at a Poisson `--request-rate` with at most
`--max-concurrency` in flight, and reports time to first token (TTFT), time per output token
(TPOT), inter-token latency (ITL) and end-to-end latency (E2E), request and output-token
throughput and errors.

The measuring client is deliberately lean so that it is not the bottleneck at tens of thousands of
tokens/s on a small machine: request bodies are serialised before the clock starts; plain-http
targets get the small keep-alive client of `shared.http1` (asyncio + httptools' C parser,
body bytes handed over in the socket callback), https targets get httpx; each server-sent event
costs one `orjson.loads` and a few dict look-ups (no pydantic, no openai SDK); uvloop is used when
installed. Measured on 2 cores against a trivial server: about 10 µs of client CPU per event and
50 µs per request on top (benchmarks/README.md has the figures).
"""

import argparse
import asyncio
import math
import os
import platform
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import orjson

from shared.http1 import BodySink, Http1Pool

Endpoint = Literal["chat", "completions"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_SYNTHETIC_REQUESTS = 100
MAX_DISTINCT_ERRORS = 5
_ERROR_BODY_LIMIT = 300
_CLOSE_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_S = 10.0
# Common English words: most tokenizers spend about one token on each.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part over new sound take only little work know place"
).split()


# --------------------------------------------------------------------------------------------
# Configuration and workload
# --------------------------------------------------------------------------------------------


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
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
        return self.base_url.rstrip("/") + path


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
    if config.stream:
        common["stream_options"] = {"include_usage": True}
    bodies = []
    for i in range(count):
        entry = entries[i % len(entries)]
        body = {**common, **entry.fields, "max_tokens": entry.max_tokens or config.output_len}
        if config.endpoint == "chat":
            body["messages"] = entry.messages or [{"role": "user", "content": entry.prompt}]
        elif entry.messages is not None:
            raise PromptsFileError('"messages" entries need --endpoint chat')
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


# --------------------------------------------------------------------------------------------
# One request
# --------------------------------------------------------------------------------------------


def error_message(payload: Any) -> str:
    """The human part of an OpenAI (or vLLM, or FastAPI) error body."""
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if payload.get("object") == "error" and payload.get("message"):  # vLLM's older shape
            return str(payload["message"])
        if "detail" in payload:
            return str(payload["detail"])
    text = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return text[:_ERROR_BODY_LIMIT]


def http_error(status: int, raw: bytes) -> str:
    try:
        payload: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = raw.decode(errors="replace").strip()
    return f"HTTP {status}: {error_message(payload)}"


class StreamParser:
    """Incremental parser of one OpenAI SSE response, timing each content-bearing event.

    `feed` takes bytes as they arrive off the socket together with their arrival time; everything
    in one read shares that time. Only `data:` lines matter (comments, `event:` and `id:` are
    ignored); `data: [DONE]` ends the stream. Times are seconds from `started_s`.
    """

    __slots__ = (
        "_buffer",
        "completion_tokens",
        "content_chunks",
        "done",
        "error",
        "itls_s",
        "last_s",
        "prompt_tokens",
        "started_s",
        "ttft_s",
    )

    def __init__(self, started_s: float) -> None:
        self.started_s = started_s
        self.ttft_s: float | None = None
        self.last_s = started_s
        self.itls_s: list[float] = []
        self.content_chunks = 0
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.error: str | None = None
        self.done = False
        self._buffer = b""

    def feed(self, data: bytes, now_s: float) -> None:
        lines = (self._buffer + data).split(b"\n") if self._buffer else data.split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), now_s)

    def finish(self) -> None:
        """Handle a last line that had no newline after it."""
        if self._buffer.startswith(b"data:"):
            self._event(self._buffer[5:].strip(), self.last_s)
        self._buffer = b""

    @property
    def output_tokens(self) -> int:
        """Completion tokens from the usage chunk, else the number of content-bearing events."""
        return self.completion_tokens if self.completion_tokens is not None else self.content_chunks

    def _event(self, payload: bytes, now_s: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            self._json_event(orjson.loads(payload), now_s)
        except orjson.JSONDecodeError:
            self.error = self.error or f"invalid JSON in stream: {payload[:100]!r}"
        except (AttributeError, TypeError, IndexError, KeyError):
            self.error = self.error or f"unexpected event in stream: {payload[:100]!r}"

    def _json_event(self, obj: Any, now_s: float) -> None:
        choices = obj.get("choices")
        if choices:
            choice = choices[0]
            delta = choice.get("delta")
            # Tool-call pieces are output as much as content is.
            text = (
                (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
                if delta is not None
                else choice.get("text")
            )
            if text:
                self.content_chunks += 1
                if self.ttft_s is None:
                    self.ttft_s = now_s - self.started_s
                else:
                    self.itls_s.append(now_s - self.last_s)
                self.last_s = now_s
        elif "error" in obj or obj.get("object") == "error":
            self.error = self.error or f"stream error: {error_message(obj)}"
        usage = obj.get("usage")
        if usage:
            self.completion_tokens = usage.get("completion_tokens")
            self.prompt_tokens = usage.get("prompt_tokens")


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times in seconds. A failed request has `error` set."""

    e2e_s: float = 0.0
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _from_stream(parser: StreamParser, e2e_s: float) -> RequestResult:
    error = parser.error or (None if parser.done else "stream ended before data: [DONE]")
    return RequestResult(
        e2e_s=e2e_s,
        ttft_s=parser.ttft_s,
        itls_s=parser.itls_s,
        output_tokens=parser.output_tokens,
        prompt_tokens=parser.prompt_tokens,
        error=error,
    )


def _from_body(raw: bytes, e2e_s: float) -> RequestResult:
    """A non-streamed answer: TTFT is the whole latency; tokens from usage, else words."""
    try:
        obj = orjson.loads(raw)
        choice = obj["choices"][0]
        text = choice["message"].get("content") if "message" in choice else choice.get("text")
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        return RequestResult(e2e_s=e2e_s, error=f"unexpected response body: {raw[:100]!r}")
    usage = obj.get("usage") or {}
    tokens = usage.get("completion_tokens")
    if tokens is None:
        tokens = len((text or "").split())
    return RequestResult(e2e_s=e2e_s, ttft_s=e2e_s, output_tokens=tokens, prompt_tokens=usage.get("prompt_tokens"))


async def send_one(poster: "Poster", body: bytes, *, stream: bool, timeout_s: float) -> RequestResult:
    """Send one request and measure it; never raises except on cancellation.

    Args:
        poster: sends the body to the endpoint (see `make_poster`).
        body: the serialised JSON request body.
        stream: parse the answer as server-sent events.
        timeout_s: deadline for the whole request, from send to last byte.
    """
    perf = time.perf_counter
    started_s = perf()
    parser = StreamParser(started_s)
    try:
        async with asyncio.timeout(timeout_s):
            status, raw = await poster.post(body, sink=parser.feed if stream else None)
    except TimeoutError:
        return _failed(parser, started_s, f"timed out after {timeout_s:g} s")
    except Exception as exc:  # noqa: BLE001 - a load generator records a failure and goes on
        return _failed(parser, started_s, f"{type(exc).__name__}: {exc}".rstrip(": "))
    e2e_s = perf() - started_s
    if status != 200:
        return RequestResult(e2e_s=e2e_s, error=http_error(status, raw))
    if not stream:
        return _from_body(raw, e2e_s)
    parser.finish()
    return _from_stream(parser, e2e_s)


def _failed(parser: StreamParser, started_s: float, error: str) -> RequestResult:
    return RequestResult(
        e2e_s=time.perf_counter() - started_s, ttft_s=parser.ttft_s, output_tokens=parser.output_tokens, error=error
    )


class Poster(Protocol):
    """POSTs request bodies to the benchmark's endpoint."""

    async def post(self, body: bytes, *, sink: BodySink | None = None) -> tuple[int, bytes]:
        """Return the status and the body; with `sink`, a 200 body goes to it as it arrives instead."""
        ...

    async def aclose(self) -> None: ...


class HttpxPoster:
    """A `Poster` on `httpx.AsyncClient`: for https, or wherever `Http1Pool` cannot go."""

    def __init__(
        self, url: str, *, headers: dict[str, str], max_connections: int | None, timeout_s: float, transport: Any = None
    ) -> None:
        import httpx

        self._url = url
        self._client = httpx.AsyncClient(
            headers=headers,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=httpx.Timeout(timeout_s),
            transport=transport,
            trust_env=False,  # a proxy from the environment would be measured too
        )

    async def post(self, body: bytes, *, sink: BodySink | None = None) -> tuple[int, bytes]:
        perf = time.perf_counter
        async with self._client.stream("POST", self._url, content=body) as response:
            if response.status_code != 200 or sink is None:
                return response.status_code, await response.aread()
            async for data in response.aiter_bytes():
                sink(data, perf())
            return 200, b""

    async def aclose(self) -> None:
        await self._client.aclose()


def request_headers(api_key: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {api_key}",
        "Content-Type": "application/json",
        "Accept-Encoding": "identity",
        "User-Agent": "axon-bench",
    }


def make_poster(config: BenchConfig, *, api_key: str, transport: Any = None) -> Poster:
    """The lean `Http1Pool` for plain http (see `shared.http1` for why), else httpx.

    Either keeps up to `max_concurrency` connections open. Passing an httpx `transport` (tests
    pass `httpx.MockTransport`) forces httpx.
    """
    headers = request_headers(api_key)
    if transport is None and Http1Pool.supports(config.url):
        return Http1Pool(
            config.url,
            headers=headers,
            max_idle_connections=config.max_concurrency,
            connect_timeout_s=min(config.timeout_s, _CONNECT_TIMEOUT_S),
        )
    return HttpxPoster(
        config.url,
        headers=headers,
        max_connections=config.max_concurrency,
        timeout_s=config.timeout_s,
        transport=transport,
    )


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RunOutcome:
    """Results of the measured requests, in completion order."""

    results: list[RequestResult]
    duration_s: float
    interrupted: bool = False
    cancelled: int = 0


async def run_requests(
    poster: Poster,
    config: BenchConfig,
    bodies: Sequence[bytes],
    *,
    offsets_s: Sequence[float] | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
    stop: asyncio.Event | None = None,
) -> RunOutcome:
    """Send `bodies` at `offsets_s` (default: all at once), at most `max_concurrency` at a time.

    Setting `stop` ends the run early: nothing more is sent, requests in flight are cancelled and
    not counted, and what finished is returned with `interrupted=True`.
    """
    offsets_s = offsets_s if offsets_s is not None else [0.0] * len(bodies)
    limit = config.max_concurrency or len(bodies) or 1
    slots = asyncio.Semaphore(limit)
    in_flight: set[asyncio.Task[RequestResult]] = set()
    results: list[RequestResult] = []
    stop = stop or asyncio.Event()

    def finished(task: asyncio.Task[RequestResult]) -> None:
        in_flight.discard(task)
        slots.release()
        if not task.cancelled():
            result = task.result()
            results.append(result)
            if on_done is not None:
                on_done(result)

    async def dispatch() -> None:
        for body, offset_s in zip(bodies, offsets_s, strict=True):
            delay_s = started_s + offset_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            # Bounded: each request in flight ends within its own timeout.
            await slots.acquire()
            task = asyncio.create_task(send_one(poster, body, stream=config.stream, timeout_s=config.timeout_s))
            in_flight.add(task)
            task.add_done_callback(finished)
        while in_flight:
            await asyncio.wait(set(in_flight))

    started_s = time.perf_counter()
    dispatcher = asyncio.create_task(dispatch())
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({dispatcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        duration_s = time.perf_counter() - started_s
        cancelled = len(in_flight)
        await _cancel_all([dispatcher, stopper, *in_flight])
    if dispatcher.done() and not dispatcher.cancelled() and (exc := dispatcher.exception()) is not None:
        raise exc
    interrupted = len(results) < len(bodies)
    return RunOutcome(results=results, duration_s=duration_s, interrupted=interrupted, cancelled=cancelled)


async def _cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel the tasks still running and wait, bounded, for them to finish."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=_CLOSE_TIMEOUT_S)


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of already sorted values, interpolating linearly (as numpy does)."""
    if not sorted_values:
        raise ValueError("no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def tpot_s(result: RequestResult) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (tokens - 1); None below two tokens."""
    if result.ttft_s is None or result.output_tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def distribution_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 in milliseconds (None when there is nothing to measure)."""
    values = sorted(values_s)
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": sum(values) / len(values) * 1000.0,
        "p50": percentile(values, 50) * 1000.0,
        "p90": percentile(values, 90) * 1000.0,
        "p99": percentile(values, 99) * 1000.0,
    }


def distinct_errors(results: Iterable[RequestResult], *, limit: int = MAX_DISTINCT_ERRORS) -> list[dict[str, Any]]:
    """The first `limit` distinct error messages in order of first appearance, with their counts."""
    counts = Counter(r.error for r in results if r.error is not None)
    return [{"message": message, "count": count} for message, count in list(counts.items())[:limit]]


def summarize(outcome: RunOutcome, config: BenchConfig) -> dict[str, Any]:
    """Every summary figure of a run, plus its configuration, ready for JSON."""
    ok = [r for r in outcome.results if r.ok]
    failed = len(outcome.results) - len(ok)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    duration_s = outcome.duration_s
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"name": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "config": _config_dict(config),
        "interrupted": outcome.interrupted,
        "duration_s": duration_s,
        "requests": {
            "sent": len(outcome.results) + outcome.cancelled,
            "completed": len(ok),
            "failed": failed,
            "cancelled": outcome.cancelled,
        },
        "request_throughput_rps": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_token_throughput_tps": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "total_input_tokens": prompt_tokens,
        "ttft_ms": distribution_ms(r.ttft_s for r in ok if r.ttft_s is not None),
        # Unstreamed, the first token arrives with the last: there is no time per output token.
        "tpot_ms": distribution_ms(t for r in ok if config.stream and (t := tpot_s(r)) is not None),
        "itl_ms": distribution_ms(itl for r in ok for itl in r.itls_s),
        "e2e_ms": distribution_ms(r.e2e_s for r in ok),
        "errors": distinct_errors(outcome.results),
    }


def _config_dict(config: BenchConfig) -> dict[str, Any]:
    data = asdict(config)
    data["url"] = config.url
    if math.isinf(config.request_rate):
        data["request_rate"] = "inf"  # JSON has no infinity
    return data


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def render_summary(summary: dict[str, Any], console: Any) -> None:
    """Print the summary as a rich table on `console`."""
    from rich.table import Table

    requests = summary["requests"]
    config = summary["config"]
    rate = config["request_rate"]
    console.print(
        f"axon bench{' (interrupted)' if summary['interrupted'] else ''}: {config['model']} at {config['url']}\n"
        f"{requests['sent']} requests, concurrency {config['max_concurrency'] or 'unlimited'}, "
        f"rate {rate if rate == 'inf' else f'{rate:g}'} req/s, {'streamed' if config['stream'] else 'not streamed'}",
        highlight=False,
        soft_wrap=True,
    )
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    for column in ("mean", "p50", "p90", "p99"):
        table.add_column(column, justify="right")
    for key, label in _METRIC_ROWS:
        table.add_row(label, *(_fmt(summary[key][column]) for column in ("mean", "p50", "p90", "p99")))
    console.print(table)
    lines = [
        ("duration", f"{summary['duration_s']:.2f} s"),
        (
            "requests",
            f"{requests['completed']} completed, {requests['failed']} failed"
            + (f", {requests['cancelled']} cancelled" if requests["cancelled"] else ""),
        ),
        ("request throughput", f"{summary['request_throughput_rps']:.2f} req/s"),
        ("output token throughput", f"{summary['output_token_throughput_tps']:.1f} tok/s"),
        ("output tokens", f"{summary['total_output_tokens']} (input tokens: {summary['total_input_tokens']})"),
    ]
    for label, value in lines:
        console.print(f"{label + ':':<25} {value}", highlight=False, soft_wrap=True)
    for error in summary["errors"]:
        message = f"error x{error['count']}: {error['message']}"
        console.print(message, style="red", highlight=False, markup=False, soft_wrap=True)


_METRIC_ROWS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "E2E (ms)"))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_json(summary: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


_EPILOG = """\
Metrics: TTFT = send to first non-empty content (or tool-call piece); TPOT = (E2E - TTFT) / (output tokens - 1), per
request; ITL = gap between consecutive content-bearing events (an event may carry several tokens);
E2E = send to last byte. Output tokens come from the final usage chunk (stream_options.include_usage
is sent), else one per content event. Throughputs count completed requests only, over the
benchmark's duration. Exit status: 0 when every request succeeded, 1 when any failed, 130 when
interrupted with Ctrl+C (the figures measured so far are still printed and written).
"""


def add_bench_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Register `axon bench` on the CLI's subparsers and return its parser."""
    bench = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server and report latency and throughput",
        description="Load-test any OpenAI-compatible server (an Axon gateway, vLLM, ...) and report\n"
        "TTFT, TPOT, ITL and end-to-end latency (mean/p50/p90/p99), throughput and errors.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = bench.add_argument_group("target")
    target.add_argument(
        "--base-url", default=DEFAULT_BASE_URL, help="OpenAI-compatible base URL (default: %(default)s)"
    )
    target.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "unused"),
        help="bearer API key (default: $OPENAI_API_KEY, else 'unused')",
    )
    target.add_argument("--model", help="model name (default: the first model GET /models lists)")
    target.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/chat/completions or /completions (default: %(default)s)",
    )
    load = bench.add_argument_group("load")
    load.add_argument(
        "--num-requests",
        type=_positive_int,
        help="requests to measure (default: one per line of --prompts-file, "
        f"else {DEFAULT_SYNTHETIC_REQUESTS}); "
        "prompts are reused in turn when there are fewer",
    )
    load.add_argument(
        "--max-concurrency",
        type=_positive_int,
        help="most requests in flight at once, also the connection pool size (default: no limit)",
    )
    load.add_argument(
        "--request-rate",
        type=_positive_float,
        default=math.inf,
        help="mean requests/s, Poisson arrivals; 'inf' sends all at once (default: inf)",
    )
    load.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=0,
        help="requests sent first and not measured (default: %(default)s)",
    )
    load.add_argument(
        "--seed", type=int, default=0, help="seed for synthetic prompts and arrival times (default: %(default)s)"
    )
    load.add_argument(
        "--timeout-s",
        type=_positive_float,
        default=300.0,
        help="deadline for each request, send to last byte (default: %(default)s)",
    )
    work = bench.add_argument_group("workload")
    work.add_argument(
        "--input-len",
        type=_positive_int,
        default=128,
        help="words per synthetic prompt, about one token each (default: %(default)s)",
    )
    work.add_argument(
        "--output-len",
        type=_positive_int,
        default=128,
        help="max_tokens per request unless the prompts file sets it (default: %(default)s)",
    )
    work.add_argument(
        "--prompts-file",
        metavar="JSONL",
        help='one {"prompt": "..."} or {"messages": [...]} object per line, optional "max_tokens" and '
        'any other request field ("tools", "response_format", ...); replaces the synthetic prompts',
    )
    work.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream the answers as server-sent events (default: stream); without streaming, "
        "TTFT is the whole latency and there is no TPOT/ITL",
    )
    work.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    out = bench.add_argument_group("output")
    out.add_argument(
        "--json", metavar="PATH", help="write every summary figure and the configuration to this JSON file"
    )
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar on stderr (default: on)",
    )
    bench.set_defaults(func=bench_command)
    return bench


def bench_command(args: argparse.Namespace) -> int:
    """Run `axon bench` from parsed arguments; returns the exit status."""
    from rich.console import Console

    err = Console(stderr=True)
    try:
        entries = load_prompts_file(args.prompts_file) if args.prompts_file else None
    except (OSError, PromptsFileError) as exc:
        _say(f"{exc}")
        return 2
    num_requests = args.num_requests or (len(entries) if entries else DEFAULT_SYNTHETIC_REQUESTS)
    _raise_open_files_limit((args.max_concurrency or num_requests + args.warmup) + 64)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(_bench_main(args, entries, num_requests, err))
    except PromptsFileError as exc:
        _say(f"{exc}")
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        _say("interrupted")
        return 130


def _raise_open_files_limit(needed: int) -> None:
    """One socket per request in flight: lift the soft descriptor limit towards the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: sockets fail visibly later
        pass


def _say(message: str) -> None:
    print(f"axon bench: {message}", file=sys.stderr, flush=True)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _bench_main(args: argparse.Namespace, entries: list[PromptEntry] | None, num_requests: int, err: Any) -> int:
    from rich.console import Console

    config = BenchConfig(
        base_url=args.base_url,
        model=args.model or "",
        endpoint=args.endpoint,
        num_requests=num_requests,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        prompts_file=args.prompts_file,
        stream=args.stream,
        seed=args.seed,
        temperature=args.temperature,
        timeout_s=args.timeout_s,
        warmup=args.warmup,
    )
    stop = asyncio.Event()
    with _stop_on_sigint(stop):
        if not config.model:
            model = await first_model(config.base_url, api_key=args.api_key, timeout_s=min(config.timeout_s, 30.0))
            if model is None:
                _say(f"no --model given and none listed at {config.base_url.rstrip('/')}/models")
                return 2
            config = replace(config, model=model)
        count = config.warmup + num_requests
        entries = entries or synthetic_prompts(count, input_len=config.input_len, seed=config.seed)
        bodies = build_bodies(config, entries, count)
        progress = _ProgressBar(err, total=num_requests, enabled=args.progress)
        poster = make_poster(config, api_key=args.api_key)
        try:
            outcome = await _warm_up_and_measure(poster, config, bodies, stop=stop, progress=progress)
        finally:
            await asyncio.wait_for(poster.aclose(), _CLOSE_TIMEOUT_S)
    summary = summarize(outcome, config)
    render_summary(summary, Console())
    if args.json:
        write_json(summary, args.json)
        _say(f"results written to {args.json}")
    if outcome.interrupted:
        return 130
    return 0 if summary["requests"]["failed"] == 0 else 1


async def _warm_up_and_measure(
    poster: Poster, config: BenchConfig, bodies: list[bytes], *, stop: asyncio.Event, progress: "_ProgressBar"
) -> RunOutcome:
    warmup, measured = bodies[: config.warmup], bodies[config.warmup :]
    if warmup:
        _say(f"{len(warmup)} warm-up request(s)...")
        warm = await run_requests(poster, config, warmup, stop=stop)
        if errors := distinct_errors(warm.results, limit=1):
            failed = sum(not r.ok for r in warm.results)
            _say(f"{failed} warm-up request(s) failed, first: {errors[0]['message']}")
    if stop.is_set():
        return RunOutcome(results=[], duration_s=0.0, interrupted=True)
    offsets_s = arrival_offsets_s(len(measured), request_rate=config.request_rate, seed=config.seed)
    with progress as on_done:
        return await run_requests(poster, config, measured, offsets_s=offsets_s, on_done=on_done, stop=stop)


async def first_model(base_url: str, *, api_key: str, timeout_s: float) -> str | None:
    """The first model id that `GET {base_url}/models` lists, or None."""
    import httpx

    try:
        async with httpx.AsyncClient(headers=request_headers(api_key), timeout=timeout_s, trust_env=False) as client:
            response = await client.get(base_url.rstrip("/") + "/models")
            data = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return data[0].get("id") if data and isinstance(data[0], dict) else None


@contextmanager
def _stop_on_sigint(stop: asyncio.Event) -> Iterator[None]:
    """First Ctrl+C: stop and report what was measured. Second: cancel everything at once."""
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()

    def handler() -> None:
        if stop.is_set() and main_task is not None:
            main_task.cancel()
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, handler)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


class _ProgressBar:
    """A rich progress bar on stderr, advanced by the `on_done` callback this context yields."""

    def __init__(self, console: Any, *, total: int, enabled: bool) -> None:
        self._console, self._total, self._enabled = console, total, enabled
        self._bar: Any = None
        self._failed = 0

    def __enter__(self) -> Callable[[RequestResult], None] | None:
        if not self._enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("bench"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            console=self._console,
            refresh_per_second=4,
            transient=True,
        )
        task_id = self._bar.add_task("bench", total=self._total, failed=0)
        self._bar.start()
        bar = self._bar

        def on_done(result: RequestResult) -> None:
            if result.error is not None:
                self._failed += 1
                bar.update(task_id, advance=1, failed=self._failed)
            else:
                bar.advance(task_id)

        return on_done

    def __exit__(self, *_exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
