"""services.cli.bench: statistics, SSE parsing, prompts files, arrival schedule, and whole runs
against a small fake OpenAI server (FastAPI under uvicorn on a loopback port)."""

import asyncio
import itertools
import json
import math
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.cli.bench import (
    BenchConfig,
    PromptEntry,
    PromptsFileError,
    RequestResult,
    StreamParser,
    arrival_offsets_s,
    build_bodies,
    distinct_errors,
    distribution_ms,
    error_message,
    http_error,
    load_prompts_file,
    make_poster,
    percentile,
    run_requests,
    summarize,
    synthetic_prompts,
    tpot_s,
)
from services.cli.bench.command import default_api_key
from services.cli.main import build_parser, main

FAKE_MODEL = "fake-model"
RATE_LIMIT_MESSAGE = "Rate limit reached for this key."
# The key the fake server's copy under /locked asks for.
LOCKED_KEY = "axk_locked"


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 100) == 5.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution_is_in_milliseconds_and_empty_gives_none() -> None:
    dist = distribution_ms([0.004, 0.001, 0.002, 0.003])
    assert dist["mean"] == pytest.approx(2.5)
    assert dist["p50"] == pytest.approx(2.5)
    assert dist["p99"] == pytest.approx(3.97)
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token() -> None:
    assert tpot_s(RequestResult(e2e_s=1.0, ttft_s=0.1, output_tokens=10)) == pytest.approx(0.1)
    assert tpot_s(RequestResult(e2e_s=1.0, ttft_s=0.1, output_tokens=1)) is None
    assert tpot_s(RequestResult(e2e_s=1.0, ttft_s=None, output_tokens=10)) is None


def test_distinct_errors_keep_first_appearance_order_and_counts() -> None:
    results = [RequestResult(error=e) for e in ["b", "a", "b", None, "c", "d", "e", "f"]]
    assert distinct_errors(results, limit=3) == [
        {"message": "b", "count": 2},
        {"message": "a", "count": 1},
        {"message": "c", "count": 1},
    ]


def test_summary_counts_only_completed_requests_in_throughput() -> None:
    from services.cli.bench import RunOutcome

    ok = RequestResult(e2e_s=1.0, ttft_s=0.1, itls_s=[0.1] * 9, output_tokens=10, prompt_tokens=5)
    bad = RequestResult(e2e_s=0.01, error="HTTP 429: slow down")
    summary = summarize(
        RunOutcome(results=[ok, ok, bad], duration_s=2.0), BenchConfig(base_url="http://x/v1", model="m")
    )
    assert summary["requests"] == {"sent": 3, "completed": 2, "failed": 1, "cancelled": 0}
    assert summary["request_throughput_rps"] == 1.0
    assert summary["output_token_throughput_tps"] == 10.0
    assert summary["total_input_tokens"] == 10
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(100.0)
    assert summary["e2e_ms"]["p99"] == pytest.approx(1000.0)
    assert summary["errors"] == [{"message": "HTTP 429: slow down", "count": 1}]
    assert summary["config"]["request_rate"] == "inf"
    orjson.dumps(summary)  # JSON-serialisable as is


# --------------------------------------------------------------------------------------------
# SSE parsing
# --------------------------------------------------------------------------------------------


def sse(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


def chat_chunk(content: str | None, *, role: bool = False, finish: str | None = None) -> dict:
    delta: dict = {"content": content} if content is not None else {}
    if role:
        delta["role"] = "assistant"
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE_CHUNK = {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}


def test_parser_times_content_events_and_reads_usage() -> None:
    parser = StreamParser(started_s=100.0)
    parser.feed(sse(chat_chunk("", role=True)), 100.05)  # role only: not content
    parser.feed(sse(chat_chunk("Hel")), 100.2)
    parser.feed(sse(chat_chunk("lo")) + sse(chat_chunk(" wor")), 100.5)
    parser.feed(sse(chat_chunk("ld")), 101.0)
    parser.feed(sse(chat_chunk(None, finish="length")) + sse(USAGE_CHUNK) + sse(b"[DONE]"), 101.1)
    parser.finish()
    assert parser.ttft_s == pytest.approx(0.2)
    assert parser.itls_s == pytest.approx([0.3, 0.0, 0.5])
    assert parser.content_chunks == 4
    assert (parser.completion_tokens, parser.prompt_tokens, parser.output_tokens) == (5, 7, 5)
    assert parser.done and parser.error is None


def test_parser_handles_events_split_anywhere_and_crlf_and_comments() -> None:
    stream = (
        b": keep-alive\r\n\r\n"
        + sse(chat_chunk("a")).replace(b"\n", b"\r\n")
        + b"event: message\nid: 3\n"
        + sse(chat_chunk("b"))
        + sse(b"[DONE]")
    )
    for size in (1, 3, 7, len(stream)):
        parser = StreamParser(started_s=0.0)
        for i in range(0, len(stream), size):
            parser.feed(stream[i : i + size], 1.0)
        parser.finish()
        assert parser.content_chunks == 2 and parser.done and parser.error is None


def test_parser_counts_content_events_when_there_is_no_usage() -> None:
    parser = StreamParser(started_s=0.0)
    parser.feed(sse({"choices": [{"index": 0, "text": "one"}]}) + sse({"choices": [{"index": 0, "text": ""}]}), 0.1)
    parser.feed(sse({"choices": [{"index": 0, "text": " two"}]}) + b"data: [DONE]", 0.2)  # no final newline
    parser.finish()
    assert parser.completion_tokens is None
    assert parser.output_tokens == 2
    assert parser.done


def test_parser_reports_an_error_event() -> None:
    parser = StreamParser(started_s=0.0)
    error = {"error": {"message": "The request's deadline passed.", "type": "timeout", "param": None, "code": None}}
    parser.feed(sse(chat_chunk("x")) + sse(error) + sse(b"[DONE]"), 0.1)
    assert parser.error == "stream error: The request's deadline passed."
    assert parser.done


@pytest.mark.parametrize(
    ("event", "error"),
    [
        (b"{not json", "invalid JSON in stream"),
        (b"[1, 2]", "unexpected event in stream"),
        (b'{"choices": [{"delta": "text"}]}', "unexpected event in stream"),
    ],
)
def test_parser_reports_malformed_events(event: bytes, error: str) -> None:
    parser = StreamParser(started_s=0.0)
    parser.feed(b"data: " + event + b"\n\n", 0.1)
    assert parser.error is not None and parser.error.startswith(error)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"error": {"message": "bad key", "type": "auth"}}, "bad key"),
        ({"object": "error", "message": "vllm says no"}, "vllm says no"),
        ({"detail": "Not Found"}, "Not Found"),
        ({"error": "plain"}, "plain"),
        ("upstream connect error", "upstream connect error"),
    ],
)
def test_error_message_shapes(payload: object, message: str) -> None:
    assert error_message(payload) == message


def test_http_error_of_a_non_json_body() -> None:
    assert http_error(502, b"<html>Bad Gateway</html>\n") == "HTTP 502: <html>Bad Gateway</html>"


# --------------------------------------------------------------------------------------------
# Workload: prompts file, synthetic prompts, request bodies, arrivals
# --------------------------------------------------------------------------------------------


def test_prompts_file_reads_prompts_messages_and_max_tokens(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "hello"}\n\n'
        '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],'
        ' "max_tokens": 9}\n'
    )
    entries = load_prompts_file(path)
    assert entries == [
        PromptEntry(prompt="hello"),
        PromptEntry(
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], max_tokens=9
        ),
    ]


def test_prompts_file_lines_carry_other_request_fields_into_their_bodies(tmp_path: Path) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        orjson.dumps({"prompt": "call f", "tools": [tool], "tool_choice": "required", "temperature": 1}).decode()
        + "\n"
        + orjson.dumps({"prompt": "as JSON", "response_format": {"type": "json_object"}, "max_tokens": 5}).decode()
    )
    entries = load_prompts_file(path)
    assert entries[0].fields == {"tools": [tool], "tool_choice": "required", "temperature": 1}
    config = BenchConfig(base_url="http://x/v1", model="m", output_len=16, temperature=0.0)
    first, second = (orjson.loads(b) for b in build_bodies(config, entries, 2))
    assert first["tools"] == [tool] and first["tool_choice"] == "required"
    assert first["temperature"] == 1  # the line's own value wins over --temperature
    assert first["model"] == "m" and first["max_tokens"] == 16 and first["stream"] is True
    assert second["response_format"] == {"type": "json_object"} and second["max_tokens"] == 5
    assert "tools" not in second


def test_parser_counts_tool_call_pieces_as_output() -> None:
    parser = StreamParser(started_s=0.0)
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    parser.feed(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [first]}}]}), 0.1)
    parser.feed(
        sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}), 0.3
    )
    parser.feed(sse(chat_chunk(None, finish="tool_calls")) + sse(b"[DONE]"), 0.4)
    parser.finish()
    assert parser.ttft_s == pytest.approx(0.1) and parser.itls_s == pytest.approx([0.2])
    assert parser.content_chunks == 2 and parser.done


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"prompt": "ok"}\n{oops\n', ":2: not JSON"),
        ('{"prompt": "x", "stream": false}\n', ":1: stream is set by the bench"),
        ('{"text": "x"}\n', ':1: needs "prompt"'),
        ('{"prompt": "x", "max_tokens": 0}\n', "max_tokens must be a positive integer"),
        ('{"messages": []}\n', "messages must be a non-empty list"),
        ("[1, 2]\n", "expected a JSON object"),
        ("\n\n", "no prompts"),
    ],
)
def test_prompts_file_errors_name_the_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(PromptsFileError, match=fragment):
        load_prompts_file(path)


def test_bodies_cycle_entries_and_carry_sampling_and_usage_request() -> None:
    config = BenchConfig(base_url="http://x/v1", model="m", output_len=16, temperature=0.5)
    entries = [PromptEntry(prompt="a"), PromptEntry(messages=[{"role": "user", "content": "b"}], max_tokens=3)]
    bodies = [orjson.loads(b) for b in build_bodies(config, entries, 3)]
    assert bodies[0] == {
        "model": "m",
        "stream": True,
        "temperature": 0.5,
        "stream_options": {"include_usage": True},
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "a"}],
    }
    assert bodies[1]["messages"] == [{"role": "user", "content": "b"}] and bodies[1]["max_tokens"] == 3
    assert bodies[2] == bodies[0]


def test_completion_bodies_use_prompt_and_refuse_chat_messages() -> None:
    config = BenchConfig(base_url="http://x/v1/", model="m", endpoint="completions", stream=False, temperature=None)
    assert config.url == "http://x/v1/completions"
    body = orjson.loads(build_bodies(config, [PromptEntry(prompt="p")], 1)[0])
    assert body == {"model": "m", "stream": False, "max_tokens": 128, "prompt": "p"}
    with pytest.raises(PromptsFileError, match="--endpoint chat or messages"):
        build_bodies(config, [PromptEntry(messages=[{"role": "user", "content": "b"}])], 1)


def test_messages_bodies_are_anthropics_and_their_stream_is_timed() -> None:
    config = BenchConfig(base_url="http://x/v1", model="m", endpoint="messages")
    assert config.url == "http://x/v1/messages"
    body = orjson.loads(build_bodies(config, [PromptEntry(prompt="p")], 1)[0])
    assert body == {
        "model": "m",
        "stream": True,
        "temperature": 0.0,
        "max_tokens": 128,
        "messages": [{"role": "user", "content": "p"}],
    }
    parser = StreamParser(started_s=100.0)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 0, "output_tokens": 0}}}
    parser.feed(b"event: message_start\n" + sse(start) + b"event: ping\n" + sse({"type": "ping"}), 100.1)
    text = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}
    parser.feed(sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}), 100.2)
    parser.feed(sse(text), 100.25)
    call = {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{}"}}
    parser.feed(sse(call), 100.5)
    assert not parser.done and parser.ttft_s == pytest.approx(0.25) and parser.itls_s == [pytest.approx(0.25)]
    usage = {"input_tokens": 4, "cache_read_input_tokens": 16, "output_tokens": 2}
    parser.feed(sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage}), 100.6)
    parser.feed(sse({"type": "message_stop"}), 100.6)
    assert parser.done and parser.error is None
    assert (parser.output_tokens, parser.prompt_tokens, parser.content_chunks) == (2, 20, 2)
    failed = StreamParser(started_s=0.0)
    failed.feed(sse({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}), 0.1)
    assert failed.error == "stream error: busy"
    # vLLM's older error shape has a `type` too: still an error.
    vllm = StreamParser(started_s=0.0)
    vllm.feed(sse({"object": "error", "message": "bad", "type": "BadRequestError"}), 0.1)
    assert vllm.error == "stream error: bad"


def test_synthetic_prompts_have_about_input_len_words_and_are_reproducible() -> None:
    prompts = synthetic_prompts(20, input_len=64, seed=3)
    assert all(len(p.prompt.split()) == 64 for p in prompts)  # type: ignore[union-attr]
    assert len({p.prompt for p in prompts}) == 20
    assert synthetic_prompts(20, input_len=64, seed=3) == prompts
    assert synthetic_prompts(20, input_len=64, seed=4) != prompts


def test_poisson_arrivals_have_mean_gap_one_over_rate() -> None:
    offsets = arrival_offsets_s(20_000, request_rate=50.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0
    assert all(gap >= 0 for gap in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 50.0, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50.0, rel=0.05)  # exponential: stdev = mean
    assert arrival_offsets_s(100, request_rate=50.0, seed=1) == offsets[:100]


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets_s(5, request_rate=math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets_s(5, request_rate=0.0, seed=0)


# --------------------------------------------------------------------------------------------
# Whole runs against a fake OpenAI server
# --------------------------------------------------------------------------------------------


def build_fake_openai(*, required_key: str | None = None) -> FastAPI:
    """Streams one word per token; prompts containing a marker trigger 429, a mid-stream error
    or a slow answer. Under /locked, the same server asking for `LOCKED_KEY` (401 otherwise)."""
    app = FastAPI()
    if required_key is None:
        app.mount("/locked", build_fake_openai(required_key=LOCKED_KEY))
    else:

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            if request.headers.get("authorization") != f"Bearer {required_key}":
                error = {"message": "Incorrect API key provided.", "type": "invalid_request_error"}
                return JSONResponse({"error": error | {"param": None, "code": "invalid_api_key"}}, status_code=401)
            return await call_next(request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]}

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await request.json()
        chat = "messages" in body
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        n_tokens = body.get("max_tokens") or 16
        if "ratelimit" in text:
            error = {"message": RATE_LIMIT_MESSAGE, "type": "rate_limit_error", "param": None, "code": "rate_limited"}
            return JSONResponse({"error": error}, status_code=429, headers={"Retry-After": "1"})
        if not body.get("stream"):
            usage = {"prompt_tokens": 3, "completion_tokens": n_tokens, "total_tokens": 3 + n_tokens}
            answer = " ".join(["w"] * n_tokens)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": answer}}
                if chat
                else {"index": 0, "text": answer}
            )
            return {"object": "chat.completion", "choices": [choice], "usage": usage}

        def chunk(piece: str) -> bytes:
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            return sse({"object": "chunk", "choices": [choice]})

        async def events() -> AsyncIterator[bytes]:
            for i in range(n_tokens):
                if "slow" in text:
                    await asyncio.sleep(5)
                if "midstream" in text and i == 2:
                    yield sse({"error": {"message": "worker lost", "type": "server_error"}})
                    yield sse(b"[DONE]")
                    return
                yield chunk("w" if i == 0 else " w")
                await asyncio.sleep(0)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 3, "completion_tokens": n_tokens, "total_tokens": 3 + n_tokens}
                yield sse({"object": "chunk", "choices": [], "usage": usage})
            yield sse(b"[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_fake_openai(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


async def bench(
    config: BenchConfig, entries: list[PromptEntry], count: int, *, transport: object = None, **kwargs: object
):
    poster = make_poster(config, api_key="test-key", transport=transport)
    try:
        return await run_requests(poster, config, build_bodies(config, entries, count), **kwargs)  # type: ignore[arg-type]
    finally:
        await poster.aclose()


# The lean HTTP/1.1 pool (the default for http://) and httpx (https, or a transport given).
CLIENTS = {"http1": lambda: None, "httpx": httpx.AsyncHTTPTransport}


MIXED = [
    PromptEntry(prompt="story one", max_tokens=8),
    PromptEntry(prompt="please ratelimit me"),
    PromptEntry(prompt="story two", max_tokens=4),
    PromptEntry(prompt="midstream failure", max_tokens=8),
    PromptEntry(prompt="story three", max_tokens=12),
]


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_streamed_run_counts_requests_tokens_and_errors(base_url: str, endpoint: str, client: str) -> None:
    config = BenchConfig(base_url=base_url, model=FAKE_MODEL, endpoint=endpoint, max_concurrency=4, timeout_s=10)  # type: ignore[arg-type]
    done: list[RequestResult] = []
    outcome = await bench(config, MIXED, 10, transport=CLIENTS[client](), offsets_s=[0.0] * 10, on_done=done.append)
    summary = summarize(outcome, config)
    assert len(done) == 10 and not outcome.interrupted
    assert summary["requests"] == {"sent": 10, "completed": 6, "failed": 4, "cancelled": 0}
    assert summary["total_output_tokens"] == 2 * (8 + 4 + 12)
    assert summary["total_input_tokens"] == 6 * 3
    assert summary["errors"] == [
        {"message": f"HTTP 429: {RATE_LIMIT_MESSAGE}", "count": 2},
        {"message": "stream error: worker lost", "count": 2},
    ] or summary["errors"] == [
        {"message": "stream error: worker lost", "count": 2},
        {"message": f"HTTP 429: {RATE_LIMIT_MESSAGE}", "count": 2},
    ]
    ok = [r for r in outcome.results if r.ok]
    assert all(len(r.itls_s) == r.output_tokens - 1 for r in ok)
    assert all(0 < r.ttft_s <= r.e2e_s for r in ok)  # type: ignore[operator]
    assert summary["tpot_ms"]["p50"] is not None and summary["itl_ms"]["p99"] is not None


@pytest.mark.parametrize("client", CLIENTS)
async def test_unstreamed_run_takes_tokens_from_usage(base_url: str, client: str) -> None:
    config = BenchConfig(base_url=base_url, model=FAKE_MODEL, stream=False, max_concurrency=2, timeout_s=10)
    outcome = await bench(
        config,
        [PromptEntry(prompt="hi", max_tokens=5), PromptEntry(prompt="ratelimit")],
        4,
        transport=CLIENTS[client](),
    )
    summary = summarize(outcome, config)
    assert summary["requests"]["completed"] == 2 and summary["requests"]["failed"] == 2
    assert summary["errors"] == [{"message": f"HTTP 429: {RATE_LIMIT_MESSAGE}", "count": 2}]
    assert summary["total_output_tokens"] == 10
    assert summary["itl_ms"]["mean"] is None
    assert summary["ttft_ms"]["mean"] == pytest.approx(summary["e2e_ms"]["mean"])


async def test_poisson_run_takes_about_its_schedule(base_url: str) -> None:
    config = BenchConfig(base_url=base_url, model=FAKE_MODEL, request_rate=100.0, timeout_s=10)
    offsets = arrival_offsets_s(20, request_rate=100.0, seed=0)
    outcome = await bench(config, [PromptEntry(prompt="hi", max_tokens=2)], 20, offsets_s=offsets)
    assert len(outcome.results) == 20 and all(r.ok for r in outcome.results)
    assert outcome.duration_s >= offsets[-1]


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_request_past_its_deadline_fails_with_a_timeout(base_url: str, client: str) -> None:
    config = BenchConfig(base_url=base_url, model=FAKE_MODEL, timeout_s=0.3)
    started = time.monotonic()
    outcome = await bench(config, [PromptEntry(prompt="slow")], 2, transport=CLIENTS[client]())
    assert time.monotonic() - started < 3
    assert [r.error for r in outcome.results] == ["timed out after 0.3 s"] * 2


async def test_stop_cancels_requests_in_flight_and_keeps_what_finished(base_url: str) -> None:
    config = BenchConfig(base_url=base_url, model=FAKE_MODEL, max_concurrency=4, timeout_s=30)
    stop = asyncio.Event()
    entries = [PromptEntry(prompt="quick", max_tokens=2)] * 2 + [PromptEntry(prompt="slow")] * 4
    asyncio.get_running_loop().call_later(0.5, stop.set)
    started = time.monotonic()
    outcome = await bench(config, entries, 6, stop=stop)
    assert time.monotonic() - started < 5
    assert outcome.interrupted
    assert len(outcome.results) == 2 and all(r.ok for r in outcome.results)
    assert outcome.cancelled == 4
    assert summarize(outcome, config)["requests"]["sent"] == 6


@pytest.mark.parametrize("client", CLIENTS)
async def test_connection_refused_is_a_counted_error(client: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = BenchConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout_s=5)
    outcome = await bench(config, [PromptEntry(prompt="x")], 3, transport=CLIENTS[client]())
    assert [r.ok for r in outcome.results] == [False] * 3
    assert outcome.results[0].error.startswith("ConnectError")  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def test_help_documents_every_option() -> None:
    bench_parser = build_parser()._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    help_text = bench_parser.format_help()
    for option in (
        "--base-url",
        "--api-key",
        "--model",
        "--endpoint",
        "--num-requests",
        "--max-concurrency",
        "--request-rate",
        "--input-len",
        "--output-len",
        "--prompts-file",
        "--stream",
        "--no-stream",
        "--seed",
        "--temperature",
        "--timeout-s",
        "--json",
        "--warmup",
        "--progress",
    ):
        assert option in help_text
    for action in bench_parser._actions:
        assert action.help, action.option_strings


def test_command_prints_a_table_and_writes_json(
    base_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"prompt": e.prompt, "max_tokens": e.max_tokens})
            if e.max_tokens
            else json.dumps({"prompt": e.prompt})
            for e in MIXED
        )
    )
    out = tmp_path / "out" / "result.json"
    status = main(
        [
            "bench",
            "--base-url",
            base_url,
            "--prompts-file",
            str(prompts),
            "--num-requests",
            "10",
            "--max-concurrency",
            "3",
            "--request-rate",
            "500",
            "--warmup",
            "2",
            "--json",
            str(out),
            "--no-progress",
            "--timeout-s",
            "10",
        ]
    )
    assert status == 1  # some requests failed
    summary = json.loads(out.read_text())
    assert summary["config"]["model"] == FAKE_MODEL  # found through GET /models
    assert summary["config"]["request_rate"] == 500.0 and summary["config"]["warmup"] == 2
    assert "api_key" not in summary["config"]
    assert summary["requests"] == {"sent": 10, "completed": 6, "failed": 4, "cancelled": 0}
    assert {e["message"] for e in summary["errors"]} == {f"HTTP 429: {RATE_LIMIT_MESSAGE}", "stream error: worker lost"}
    printed = capsys.readouterr().out
    for label in ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "E2E (ms)", "request throughput", "output token throughput"):
        assert label in printed
    assert RATE_LIMIT_MESSAGE in printed


def test_command_succeeds_with_synthetic_prompts(base_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        [
            "bench",
            "--base-url",
            base_url,
            "--model",
            FAKE_MODEL,
            "--num-requests",
            "8",
            "--input-len",
            "10",
            "--output-len",
            "5",
            "--endpoint",
            "completions",
            "--no-progress",
        ]
    )
    assert status == 0
    assert "8 completed, 0 failed" in capsys.readouterr().out


def test_api_key_defaults_to_axon_api_key_then_openai_api_key() -> None:
    assert default_api_key({"AXON_API_KEY": "axk_a", "OPENAI_API_KEY": "sk-b"}) == "axk_a"
    assert default_api_key({"OPENAI_API_KEY": "sk-b"}) == "sk-b"
    assert default_api_key({}) == "unused"


def test_command_takes_the_key_from_axon_api_key(
    base_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AXON_API_KEY", LOCKED_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-another-server")
    locked = base_url.replace("/v1", "/locked/v1")
    status = main(["bench", "--base-url", locked, "--num-requests", "2", "--output-len", "3", "--no-progress"])
    assert status == 0
    assert "2 completed, 0 failed" in capsys.readouterr().out


def test_command_reports_a_refused_key_as_such(
    base_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AXON_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong")
    locked = base_url.replace("/v1", "/locked/v1")
    assert main(["bench", "--base-url", locked, "--num-requests", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"GET {locked}/models refused the API key: HTTP 401: Incorrect API key provided." in err
    assert "provided. (give the key with --api-key or export AXON_API_KEY)" in err
    assert "none listed" not in err


def test_command_rejects_a_bad_prompts_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text("{nope\n")
    assert main(["bench", "--prompts-file", str(prompts), "--model", "m"]) == 2
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().err
