"""`axon bench`'s client: one request sent and timed (the SSE parser that times each event, the
lean `Http1Pool` for plain http or httpx), and the run that sends the bodies at their offsets with
at most `max_concurrency` in flight."""

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from services.cli.bench.workload import BenchConfig
from shared.http1 import BodySink, Http1Pool

_ERROR_BODY_LIMIT = 300
CLOSE_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_S = 10.0


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
    """Incremental parser of one OpenAI SSE response (or Anthropic's, of `/v1/messages`), timing
    each content-bearing event.

    `feed` takes bytes as they arrive off the socket together with their arrival time; everything
    in one read shares that time. Only `data:` lines matter (comments, `event:` and `id:` are
    ignored); `data: [DONE]` ends the stream (Anthropic's: a `message_stop` event). Times are
    seconds from `started_s`.
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
        kind = obj.get("type")
        if kind is not None and "object" not in obj:  # Anthropic's events: a type, no `object`
            self._anthropic_event(kind, obj, now_s)
            return
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
                self._content(now_s)
        elif "error" in obj or obj.get("object") == "error":
            self.error = self.error or f"stream error: {error_message(obj)}"
        usage = obj.get("usage")
        if usage:
            self.completion_tokens = usage.get("completion_tokens")
            self.prompt_tokens = usage.get("prompt_tokens")

    def _anthropic_event(self, kind: str, obj: Any, now_s: float) -> None:
        if kind == "content_block_delta":
            delta = obj["delta"]
            if delta.get("text") or delta.get("partial_json"):
                self._content(now_s)
        elif kind == "message_delta":
            usage = obj["usage"]
            self.completion_tokens = usage.get("output_tokens")
            self.prompt_tokens = (usage.get("input_tokens") or 0) + (usage.get("cache_read_input_tokens") or 0)
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            self.error = self.error or f"stream error: {error_message(obj)}"

    def _content(self, now_s: float) -> None:
        self.content_chunks += 1
        if self.ttft_s is None:
            self.ttft_s = now_s - self.started_s
        else:
            self.itls_s.append(now_s - self.last_s)
        self.last_s = now_s


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
    error = parser.error or (None if parser.done else "stream ended before its end (data: [DONE], message_stop)")
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
        if obj.get("type") == "message":  # Anthropic's Message
            text = "".join(block.get("text", "") for block in obj["content"])
            usage = obj["usage"]
            prompt = (usage.get("input_tokens") or 0) + (usage.get("cache_read_input_tokens") or 0)
            return RequestResult(e2e_s=e2e_s, ttft_s=e2e_s, output_tokens=usage["output_tokens"], prompt_tokens=prompt)
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
        await asyncio.wait(pending, timeout=CLOSE_TIMEOUT_S)
