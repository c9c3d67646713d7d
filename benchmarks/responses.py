"""The Responses API's costs (issue 16): streaming against chat completions, replay on resume,
and the memory one in-flight response holds.

    .venv/bin/python benchmarks/responses.py streaming     # Responses vs chat streams, ~3 min
    .venv/bin/python benchmarks/responses.py replay        # resumes of finished responses, ~1 min
    .venv/bin/python benchmarks/responses.py memory        # one 500-token response's footprint

Each starts its own worker (`sim`), session manager and gateway, with a database and Redis
namespace of their own (removed at the end).

- `streaming`: the same simulator load as `engine_vs_stack.py` (64 streams kept in flight,
  128-token answers, steady arrival), sent alternately as chat completion streams
  (`/v1/chat/completions`) and as Responses streams (`POST /v1/responses`, `stream`, stored: the
  path with the most work), `--pairs` times in one run, so both see the same machine. Per pair
  and overall: TTFT p50/p99, output tokens/s and the CPU the gateway and the session manager
  spent per request, and Responses against chat. Targets: TTFT p50 added <= 1 ms, throughput
  ratio >= 0.97. On a shared machine the latencies move with the other load; the CPU per request
  does much less.
- `replay`: `--responses` stored responses of `--tokens` tokens are created and finished, then
  `--clients` clients each resume one after another (`GET /v1/responses/{id}?stream=true`, the
  whole stream) for `--seconds`, straight to the session manager (as the gateway forwards them),
  counting the events received. Target: >= 50,000 events/s from one session manager.
- `memory`: while a stored, streamed response of `--tokens` tokens is being generated, Redis's
  `MEMORY USAGE` of its record (`<ns>:response:<id>`), of its job's chunk log
  (`<ns>:chunks:<job_id>`) and its lease entries, and after it finished; then what the session
  manager holds for one response in flight, measured in this process with `tracemalloc`: the
  event builder fed the same number of chunks, its target and record, and the relay's
  per-request objects.
"""

import argparse
import asyncio
import statistics
import sys
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import orjson
from engine_vs_stack import prompt
from harness import INTERNAL_TOKEN, BenchEnvironment, CpuMeter

from services.cli.bench import StreamParser, request_headers, send_one
from shared.http1 import Http1Client, Http1Pool

MODEL = "sim"


def sim_env(*, streams: int, ttft_ms: float, itl_ms: float) -> dict[str, str]:
    return {
        "AXON_ENGINE": "sim",
        "AXON_MODEL": MODEL,
        "AXON_SIM_MAX_SEQS": str(streams),
        "AXON_SIM_TTFT_MS": str(ttft_ms),
        "AXON_SIM_ITL_MS": str(itl_ms),
    }


@dataclass
class Run:
    """One mode's requests in one round."""

    ttfts_s: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0
    wall_s: float = 0.0
    # CPU seconds each measured process spent on the round.
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return len(self.ttfts_s) + self.errors

    def cpu_ms_per_request(self, process: str) -> float:
        return self.cpu_s.get(process, 0.0) * 1000 / max(self.requests, 1)

    def ttft_ms(self, q: float) -> float:
        ordered = sorted(self.ttfts_s)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1000 if ordered else float("nan")

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


class ResponsesParser(StreamParser):
    """`StreamParser` for a Responses stream: text deltas are the content events, and the
    terminal event (with the response's usage) ends it."""

    __slots__ = ()

    def _json_event(self, obj: dict, now_s: float) -> None:
        kind = obj.get("type")
        if kind == "response.output_text.delta":
            self.content_chunks += 1
            if self.ttft_s is None:
                self.ttft_s = now_s - self.started_s
            else:
                self.itls_s.append(now_s - self.last_s)
            self.last_s = now_s
        elif kind in ("response.completed", "response.incomplete"):
            self.done = True
            self.completion_tokens = obj["response"]["usage"]["output_tokens"]
        elif kind in ("response.failed", "error"):
            self.error = self.error or f"stream error: {obj}"


async def responses_one(pool: Http1Pool, body: bytes) -> tuple[float | None, int, str | None]:
    parser = ResponsesParser(time.perf_counter())
    try:
        async with asyncio.timeout(600):
            status, raw = await pool.post(body, sink=parser.feed)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        return None, 0, repr(exc)
    if status != 200:
        return None, 0, f"{status}: {raw[:200]!r}"
    parser.finish()
    return parser.ttft_s, parser.output_tokens, parser.error or (None if parser.done else "no terminal event")


async def chat_one(pool: Http1Pool, i: int, max_tokens: int) -> tuple[float | None, int, str | None]:
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt(i)}],
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    result = await send_one(pool, body, stream=True, timeout_s=600)
    return result.ttft_s, result.output_tokens, result.error


async def round_of(one, *, streams: int, rounds: int, spacing_s: float) -> Run:  # type: ignore[no-untyped-def]
    """`streams` closed loops of `rounds` requests; stream k starts at k x `spacing_s`."""
    run = Run()

    async def stream(k: int) -> None:
        await asyncio.sleep(k * spacing_s)
        for r in range(rounds):
            ttft_s, tokens, error = await one(k + r * streams)
            if error is not None:
                run.errors += 1
                continue
            run.ttfts_s.append(ttft_s or 0.0)
            run.tokens += tokens

    started = time.perf_counter()
    await asyncio.gather(*(stream(k) for k in range(streams)))
    run.wall_s = time.perf_counter() - started
    return run


async def streaming(args: argparse.Namespace, gateway_url: str, key: str, pids: dict[str, list[int]]) -> int:
    headers = request_headers(key)
    chat = Http1Pool(
        f"{gateway_url}/v1/chat/completions", headers=headers, max_idle_connections=args.streams, connect_timeout_s=10
    )
    responses = Http1Pool(
        f"{gateway_url}/v1/responses", headers=headers, max_idle_connections=args.streams, connect_timeout_s=10
    )

    def responses_body(i: int) -> bytes:
        return orjson.dumps(
            {
                "model": MODEL,
                "input": prompt(i),
                "max_output_tokens": args.max_tokens,
                "temperature": 0.7,
                "stream": True,
            }
        )

    modes = {
        "chat": lambda i: chat_one(chat, i, args.max_tokens),
        "responses": lambda i: responses_one(responses, responses_body(i)),
    }
    try:
        pairs = await alternated_pairs(modes, args, pids)
    finally:
        await chat.aclose()
        await responses.aclose()
    return report_streaming(args, pairs)


async def alternated_pairs(
    modes: Mapping[str, Callable[[int], Awaitable[tuple[float | None, int, str | None]]]],
    args: argparse.Namespace,
    pids: dict[str, list[int]],
) -> list[dict[str, Run]]:
    """Each of `modes` (name: one request's coroutine function) once warmed up, then `args.pairs`
    pairs of rounds, the modes alternated (the first first in odd pairs, last in even ones), each
    round's CPU of the `pids` measured with it."""
    spacing_s = (args.sim_ttft_ms + args.max_tokens * args.sim_itl_ms) / 1000 / args.streams
    for one in modes.values():  # warm-up
        await one(0)
    pairs: list[dict[str, Run]] = []
    for pair in range(args.pairs):
        order = list(modes) if pair % 2 == 0 else list(reversed(modes))
        runs = {}
        for mode in order:
            meter = CpuMeter(pids)
            meter.start()
            runs[mode] = await round_of(modes[mode], streams=args.streams, rounds=args.rounds, spacing_s=spacing_s)
            runs[mode].cpu_s = meter.stop()
        pairs.append(runs)
        print(f"pair {pair + 1}/{args.pairs} done", file=sys.stderr, flush=True)
    return pairs


def report_streaming(args: argparse.Namespace, pairs: list[dict[str, Run]]) -> int:
    print(
        f"\nsim engine (TTFT {args.sim_ttft_ms:g} ms, ITL {args.sim_itl_ms:g} ms), {args.streams} streams x "
        f"{args.rounds} requests of {args.max_tokens} tokens per mode and pair, modes alternated, {args.pairs} pairs"
    )
    print(
        f"{'pair':>4} {'mode':<10} {'requests':>8} {'errors':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
        f"{'output tok/s':>13} {'gateway CPU ms/req':>19} {'sessions CPU ms/req':>20}"
    )
    for number, runs in enumerate(pairs, 1):
        for mode, run in runs.items():
            print(
                f"{number:>4} {mode:<10} {run.requests:>8} {run.errors:>6} {run.ttft_ms(50):>12.1f} "
                f"{run.ttft_ms(99):>12.1f} {run.tok_s:>13.1f} {run.cpu_ms_per_request('gateway'):>19.2f} "
                f"{run.cpu_ms_per_request('sessions'):>20.2f}"
            )
    added = [runs["responses"].ttft_ms(50) - runs["chat"].ttft_ms(50) for runs in pairs]
    ratios = [runs["responses"].tok_s / runs["chat"].tok_s for runs in pairs]
    merged = {mode: Run() for mode in ("chat", "responses")}
    for runs in pairs:
        for mode, run in runs.items():
            merged[mode].ttfts_s += run.ttfts_s
            merged[mode].tokens += run.tokens
            merged[mode].errors += run.errors
            merged[mode].wall_s += run.wall_s
            for process, seconds in run.cpu_s.items():
                merged[mode].cpu_s[process] = merged[mode].cpu_s.get(process, 0.0) + seconds
    all_added = merged["responses"].ttft_ms(50) - merged["chat"].ttft_ms(50)
    ratio = merged["responses"].tok_s / merged["chat"].tok_s
    print(f"TTFT p50 added per pair (ms): {', '.join(f'{a:+.1f}' for a in added)}")
    print(f"throughput ratio per pair: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(
        f"all pairs: TTFT p50 added {all_added:+.2f} ms (median of pairs {statistics.median(added):+.2f}; "
        f"target <= 1: {'ok' if all_added <= 1 else 'MISSED'}), "
        f"p99 added {merged['responses'].ttft_ms(99) - merged['chat'].ttft_ms(99):+.1f} ms; "
        f"throughput ratio {ratio:.3f} (target >= 0.97: {'ok' if ratio >= 0.97 else 'MISSED'})"
    )
    chat, responses = merged["chat"], merged["responses"]
    print(
        "CPU per request, responses / chat: "
        + ", ".join(
            f"{process} {responses.cpu_ms_per_request(process):.2f} / {chat.cpu_ms_per_request(process):.2f} ms "
            f"({responses.cpu_ms_per_request(process) - chat.cpu_ms_per_request(process):+.2f})"
            for process in ("gateway", "sessions")
        )
    )
    return 0 if chat.errors == responses.errors == 0 else 1


async def finished_responses(gateway_url: str, key: str, *, count: int, tokens: int) -> list[str]:
    """`count` stored responses of `tokens` tokens each, finished."""
    pool = Http1Pool(
        f"{gateway_url}/v1/responses", headers=request_headers(key), max_idle_connections=32, connect_timeout_s=10
    )
    ids: list[str] = []
    limit = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        body = orjson.dumps({"model": MODEL, "input": prompt(i), "max_output_tokens": tokens})
        async with limit:
            status, raw = await pool.post(body)
        if status != 200:
            raise RuntimeError(f"create: {status} {raw[:200]!r}")
        ids.append(orjson.loads(raw)["id"])

    try:
        await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        await pool.aclose()
    return ids


async def replay(args: argparse.Namespace, sessions_url: str, gateway_url: str, key: str) -> int:
    ids = await finished_responses(gateway_url, key, count=args.responses, tokens=args.tokens)
    print(f"{len(ids)} responses stored; resuming them...", file=sys.stderr, flush=True)
    client = Http1Client(sessions_url, max_idle_connections=args.clients, connect_timeout_s=10, read_timeout_s=60)
    headers = [("Authorization", f"Bearer {INTERNAL_TOKEN}"), ("x-axon-tenant", "bench"), ("Connection", "keep-alive")]
    heads = [client.head("GET", f"/v1/responses/{i}?stream=true", headers) for i in ids]
    events = replays = errors = 0
    first_bytes: list[float] = []

    async def resume(k: int, until: float) -> None:
        nonlocal events, replays, errors
        n = k
        while time.perf_counter() < until:
            started = time.perf_counter()
            response = await client.send(heads[n % len(heads)], None)
            n += args.clients
            if response.status != 200:
                errors += 1
                await response.read()
                continue
            count, first = 0, None
            async for piece in response.pieces():
                first = first or time.perf_counter() - started
                count += piece.count(b"\nid: ")
            events += count
            replays += 1
            first_bytes.append(first or 0.0)

    await resume(0, time.perf_counter() + 1)  # warm-up
    events = replays = errors = 0
    first_bytes.clear()
    started = time.perf_counter()
    until = started + args.seconds
    await asyncio.gather(*(resume(k, until) for k in range(args.clients)))
    wall_s = time.perf_counter() - started
    await client.aclose()
    rate = events / wall_s
    ordered = sorted(first_bytes)
    print(
        f"\n{args.clients} clients resuming {len(ids)} finished responses of {args.tokens} tokens "
        f"(whole streams, straight to one session manager) for {wall_s:.1f} s"
    )
    print(
        f"replays {replays}, errors {errors}, events {events} ({events / max(replays, 1):.0f} per replay); "
        f"first byte p50 {ordered[len(ordered) // 2] * 1000:.1f} ms"
    )
    print(f"replay: {rate:,.0f} events/s (target >= 50,000: {'ok' if rate >= 50_000 else 'MISSED'})")
    return 0 if errors == 0 else 1


async def memory(args: argparse.Namespace, gateway_url: str, key: str, env: BenchEnvironment) -> int:
    from shared.clients import create_redis
    from shared.names import Names

    redis = create_redis(env.redis_url, timeout_s=5)
    names = Names(env.namespace)
    body = {"model": MODEL, "input": prompt(0), "max_output_tokens": args.tokens, "stream": True}
    pool = Http1Pool(
        f"{gateway_url}/v1/responses", headers=request_headers(key), max_idle_connections=1, connect_timeout_s=10
    )
    seen: dict[str, str] = {}
    sizes: dict[str, dict[str, int]] = {}

    async def sample(label: str) -> None:
        record = await redis.get(names.response(seen["id"]))
        job_id = orjson.loads(record)["job_id"]
        keys = {"record": names.response(seen["id"]), "chunk log": names.chunk_log(job_id)}
        sizes[label] = {name: int(await redis.memory_usage(k, samples=0) or 0) for name, k in keys.items()}
        sizes[label]["chunks"] = int(await redis.xlen(keys["chunk log"]))

    def feed(data: bytes, now_s: float) -> None:
        if "id" not in seen and b'"id":"resp_' in data:
            start = data.index(b'"id":"resp_') + 6
            seen["id"] = data[start : data.index(b'"', start)].decode()

    async def watch() -> None:
        while "id" not in seen:
            await asyncio.sleep(0.01)
        await asyncio.sleep(args.tokens * args.sim_itl_ms / 1000 / 2)
        await sample("in flight (half generated)")

    watcher = asyncio.create_task(watch())
    status, _ = await pool.post(orjson.dumps(body), sink=feed)
    await watcher
    await sample("finished")
    await pool.aclose()
    await redis.aclose()
    print(f"\none stored, streamed response of {args.tokens} tokens (sim words), Redis MEMORY USAGE (bytes):")
    for label, figures in sizes.items():
        print(
            f"  {label:<28} record {figures['record']:>7}  chunk log {figures['chunk log']:>7} "
            f"({figures['chunks']} chunks)  total {figures['record'] + figures['chunk log']:>7}"
        )
    print("  lease while unfinished: one member of <ns>:responses:running and one field of :owners")
    print(f"session manager, per response in flight (tracemalloc, {args.tokens} chunks): {session_bytes(args.tokens)}")
    return 0 if status == 200 else 1


def session_bytes(tokens: int) -> str:
    """What the session manager holds for one stored response in flight, built here as it builds
    them: its target and record, the relay's per-request objects and the event builder fed
    `tokens` one-word chunks."""
    from services.sessions.active_request import Choice
    from services.sessions.chat.protocol import Answer, ResponseBuilder
    from services.sessions.responses.service import ResponseEvents, Target, response_object, skeleton_of
    from shared.responses_requests import ResponseCreate
    from shared.schemas import Job, Message, Sampling, TokenChunk

    body = ResponseCreate(model=MODEL, input=prompt(0), max_output_tokens=tokens, stream=True)
    chunks = [TokenChunk(seq=i, text=" word", n_tokens=1) for i in range(tokens)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    response_id = "resp_" + uuid.uuid4().hex
    initial = response_object(
        body,
        response_id=response_id,
        created_at=time.time(),
        status="in_progress",
        output=[],
        usage=None,
        conversation=None,
    )
    new = [Message(role="user", content=prompt(0))]
    target = Target(
        response_id=response_id,
        tenant="bench",
        initial=initial,
        history=[],
        new=new,
        input_items=[],
        session=None,
        stored=True,
    )
    job = Job(
        job_id=str(uuid.uuid4()),
        model=MODEL,
        messages=new,
        sampling=Sampling(max_tokens=tokens),
        channel="ns:tokens:x",
        deadline=time.time() + 300,
        tenant="bench",
    )
    choice = Choice(0, job)
    builder = ResponseBuilder(kind="chat", job_id=job.job_id, model=MODEL)
    events = ResponseEvents(skeleton_of(initial))
    answer: Answer = choice.answer
    for chunk in chunks:
        answer.text.append(chunk.text)
        events.chunk(chunk)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    held = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    del target, builder, events
    return f"{held:,} bytes"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["streaming", "replay", "memory"])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream, per mode and pair")
    parser.add_argument("--pairs", type=int, default=4, help="chat and Responses rounds, alternated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sim-ttft-ms", type=float, default=50.0)
    parser.add_argument("--sim-itl-ms", type=float, default=20.0)
    parser.add_argument("--responses", type=int, default=100, help="replay: finished responses to resume")
    parser.add_argument("--tokens", type=int, default=500, help="replay, memory: tokens per response")
    parser.add_argument("--clients", type=int, default=32, help="replay: concurrent resuming clients")
    parser.add_argument("--seconds", type=float, default=20.0, help="replay: how long to resume")
    args = parser.parse_args()
    if args.mode == "streaming":
        worker = sim_env(streams=args.streams, ttft_ms=args.sim_ttft_ms, itl_ms=args.sim_itl_ms)
    elif args.mode == "memory":
        args.sim_itl_ms = 10.0
        worker = sim_env(streams=8, ttft_ms=20, itl_ms=args.sim_itl_ms)
    else:  # 5 ms a token: one chunk per token (at 0 the simulator hands out many per chunk)
        worker = sim_env(streams=64, ttft_ms=0, itl_ms=5)
    with BenchEnvironment() as env:
        stack = env.start_stack(worker)
        key = env.create_key()
        print(f"platform ready (logs in {env.log_dir})", file=sys.stderr, flush=True)
        gateway = stack["gateway"].url
        if args.mode == "streaming":
            pids = {name: [stack[name].pid] for name in ("gateway", "sessions")}
            return asyncio.run(streaming(args, gateway, key, pids))
        if args.mode == "replay":
            return asyncio.run(replay(args, stack["sessions"].url, gateway, key))
        return asyncio.run(memory(args, gateway, key, env))


if __name__ == "__main__":
    sys.exit(main())
