"""Overhead: one engine driven directly in this process, then the same engine behind the whole
platform (gateway -> session manager -> RabbitMQ -> worker -> Redis -> SSE back), in one run, with
the same prompts, lengths and concurrency; prints both and what the platform adds.

    .venv/bin/python benchmarks/engine_vs_stack.py --engine sim                 # 64 streams, ~2 min
    .venv/bin/python benchmarks/engine_vs_stack.py --engine transformers        # 16 streams, ~4 min
    .venv/bin/python benchmarks/engine_vs_stack.py --engine vllm                # 16 streams, ~3 min

The engine comes from the worker's own factory with the worker's settings (`sim`:
AXON_SIM_TTFT_MS, AXON_SIM_ITL_MS from `--sim-ttft-ms`, `--sim-itl-ms`; `transformers` and
`vllm`: the bundled SmolLM2 on the CPU). Against vLLM's own server instead of the engine in a
process: benchmarks/vllm_serve_vs_stack.py. The platform is started here (its own database, Redis namespace
and queues, removed at the end); the in-process engine is stopped before the platform's worker
serves, so the two never compete for the CPU.

`--streams` requests are kept in flight: each stream sends its next request as soon as its
previous one ends, `--rounds` times. With `--arrival steady` (the default) stream k starts at
k/N of one answer's duration, so requests arrive spread out, as at N concurrent streams in steady
state; `--arrival burst` starts them all at once (the worst case for time to first token). Both
sides get exactly the same schedule. The stack side is measured with the lean HTTP client of
`axon bench` (its SSE parsing costs about 10 µs of CPU an event).

Figures: time to first token (TTFT) and inter-token latency (ITL: the gap between consecutive
content events) at p50/p99, and output tokens/s over the whole run. Targets: throughput ratio
stack/direct >= 0.98, TTFT added p50 <= 5 ms and p99 <= 25 ms, ITL added p50 <= 1 ms.

And the CPU milliseconds per generated token (`/proc`'s user + system time over the measured
requests, warm-up aside): the direct side's is this process's (the engine and its in-process
client; a vLLM engine's processes too); the stack's, of the gateway, the session manager and the
worker each and the three together (target <= 0.06), then, beside them, of the worker's engine
processes (vLLM's), Redis, RabbitMQ, PostgreSQL and this process (the client).
"""

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from harness import BenchEnvironment, CpuMeter, cpu_seconds, loop_factory, server_pids

from services.cli.bench import request_headers, send_one
from services.cli.launcher import Service
from services.worker.engines.base import Engine, GenerationRequest
from services.worker.engines.factory import create_engine
from services.worker.engines.orphans import descendants
from services.worker.settings import WorkerSettings
from shared.http1 import Http1Pool
from shared.schemas import Message, Sampling

# The platform's own processes: their CPU per token together is the figure with a target.
SERVICES = ("gateway", "sessions", "worker")
CPU_TARGET_MS = 0.06

TOPICS = ["dragons", "the sea", "a robot", "a lighthouse", "winter", "a city", "bees", "the moon"]


def prompt(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}."


@dataclass
class Result:
    ttft_s: float
    itls_s: list[float]
    tokens: int
    error: str | None = None


@dataclass
class Side:
    name: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    # CPU seconds each watched process (or group of processes) spent on the measured requests.
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.error is None]

    def percentile_ms(self, values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1000 if ordered else float("nan")

    def figures(self) -> dict:
        ok = self.ok
        ttfts = [r.ttft_s for r in ok]
        itls = [gap for r in ok for gap in r.itls_s]
        tokens = sum(r.tokens for r in ok)
        return {
            "requests": len(self.results),
            "errors": len(self.results) - len(ok),
            "tokens": tokens,
            "output_tok_s": tokens / self.wall_s if self.wall_s else 0.0,
            "ttft_p50_ms": self.percentile_ms(ttfts, 50),
            "ttft_p99_ms": self.percentile_ms(ttfts, 99),
            "itl_p50_ms": self.percentile_ms(itls, 50),
            "itl_p99_ms": self.percentile_ms(itls, 99),
        }


async def run_streams(one: Callable[[int], Awaitable[Result]], *, streams: int, rounds: int, spacing_s: float) -> Side:
    """`streams` closed loops of `rounds` requests each; stream k starts at k x `spacing_s`."""
    side = Side("")

    async def stream(k: int) -> None:
        await asyncio.sleep(k * spacing_s)
        for r in range(rounds):
            side.results.append(await one(k + r * streams))

    started = time.perf_counter()
    await asyncio.gather(*(stream(k) for k in range(streams)))
    side.wall_s = time.perf_counter() - started
    return side


async def direct_one(engine: Engine, i: int, max_tokens: int) -> Result:
    request = GenerationRequest(
        request_id=str(uuid.uuid4()),
        sampling=Sampling(max_tokens=max_tokens, temperature=0.7),
        messages=[Message(role="user", content=prompt(i))],
    )
    started = last = time.perf_counter()
    ttft, gaps, tokens = None, [], 0
    async for out in engine.generate(request):
        now = time.perf_counter()
        if out.text:
            if ttft is None:
                ttft = now - started
            else:
                gaps.append(now - last)
            last = now
        tokens = out.completion_tokens
    return Result(ttft or 0.0, gaps, tokens)


def own_cpu_s() -> float:
    """CPU seconds this process and the processes it started (a vLLM engine's) have used."""
    pid = os.getpid()
    return sum(cpu_seconds(p) or 0.0 for p in (pid, *descendants(pid)))


async def stack_one(pool: Http1Pool, model: str, i: int, max_tokens: int) -> Result:
    body = orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt(i)}],
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    result = await send_one(pool, body, stream=True, timeout_s=600)
    return Result(result.ttft_s or 0.0, result.itls_s, result.output_tokens, result.error)


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    env = {"AXON_ENGINE": args.engine, "AXON_MODEL": args.model, "AXON_MAX_SEQS": str(args.streams)}
    if args.engine == "sim":
        env |= {"AXON_SIM_TTFT_MS": str(args.sim_ttft_ms), "AXON_SIM_ITL_MS": str(args.sim_itl_ms)}
    return env


async def measure_direct(args: argparse.Namespace, spacing_s: float) -> Side:
    os.environ.update(worker_env(args))  # the worker's own settings, read as the worker reads them
    engine = create_engine(WorkerSettings())
    await engine.start()
    try:
        await direct_one(engine, 0, 4)  # warm-up
        before = own_cpu_s()
        side = await run_streams(
            lambda i: direct_one(engine, i, args.max_tokens),
            streams=args.streams,
            rounds=args.rounds,
            spacing_s=spacing_s,
        )
        side.cpu_s = {"direct engine": own_cpu_s() - before}
    finally:
        await engine.stop()
    side.name = "direct engine"
    return side


def stack_pids(stack: dict[str, Service]) -> dict[str, list[int]]:
    """The processes whose CPU the stack side reports: the three services, the worker's engine
    processes, the shared servers and this process (the client)."""
    return {
        **{name: [stack[name].pid] for name in SERVICES},
        "engine processes": descendants(stack["worker"].pid),
        **server_pids(),
        "client": [os.getpid()],
    }


async def measure_stack(
    args: argparse.Namespace, gateway_url: str, key: str, spacing_s: float, pids: dict[str, list[int]]
) -> Side:
    meter = CpuMeter(pids)
    pool = Http1Pool(
        f"{gateway_url}/v1/chat/completions",
        headers=request_headers(key),
        max_idle_connections=args.streams,
        connect_timeout_s=10,
    )
    try:
        await stack_one(pool, args.model, 0, 4)  # warm-up
        meter.start()
        side = await run_streams(
            lambda i: stack_one(pool, args.model, i, args.max_tokens),
            streams=args.streams,
            rounds=args.rounds,
            spacing_s=spacing_s,
        )
        side.cpu_s = meter.stop()
    finally:
        await pool.aclose()
    side.name = "full stack"
    return side


async def answer_duration_s(args: argparse.Namespace) -> float:
    """How long one answer takes on its own (the sim's is known; the real engine's is measured)."""
    if args.engine == "sim":
        return (args.sim_ttft_ms + args.max_tokens * args.sim_itl_ms) / 1000
    os.environ.update(worker_env(args))
    engine = create_engine(WorkerSettings())
    await engine.start()
    try:
        started = time.perf_counter()
        await direct_one(engine, 0, args.max_tokens)
        return time.perf_counter() - started
    finally:
        await engine.stop()


def report(args: argparse.Namespace, direct: Side, stack: Side, spacing_s: float) -> dict:
    d, s = direct.figures(), stack.figures()
    print(
        f"\n{args.engine} engine, {args.streams} streams x {args.rounds} requests of {args.max_tokens} tokens, "
        f"arrival {args.arrival} (stream k starts at k x {spacing_s * 1000:.0f} ms); {os.cpu_count()} CPUs"
    )
    print(
        f"{'path':<14} {'requests':>8} {'errors':>6} {'tokens':>7} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
        f"{'ITL p50 ms':>11} {'ITL p99 ms':>11} {'output tok/s':>13}"
    )
    for name, f in ((direct.name, d), (stack.name, s)):
        print(
            f"{name:<14} {f['requests']:>8} {f['errors']:>6} {f['tokens']:>7} {f['ttft_p50_ms']:>12.1f} "
            f"{f['ttft_p99_ms']:>12.1f} {f['itl_p50_ms']:>11.2f} {f['itl_p99_ms']:>11.2f} {f['output_tok_s']:>13.1f}"
        )
    added = {
        "throughput_ratio": s["output_tok_s"] / d["output_tok_s"] if d["output_tok_s"] else float("nan"),
        "ttft_added_p50_ms": s["ttft_p50_ms"] - d["ttft_p50_ms"],
        "ttft_added_p99_ms": s["ttft_p99_ms"] - d["ttft_p99_ms"],
        "itl_added_p50_ms": s["itl_p50_ms"] - d["itl_p50_ms"],
    }

    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    print(
        f"stack/direct output tok/s = {added['throughput_ratio']:.3f} (target >= 0.98: "
        f"{verdict(added['throughput_ratio'] >= 0.98)})"
    )
    print(
        f"TTFT added: p50 {added['ttft_added_p50_ms']:+.1f} ms "
        f"(target <= 5: {verdict(added['ttft_added_p50_ms'] <= 5)}), "
        f"p99 {added['ttft_added_p99_ms']:+.1f} ms (target <= 25: {verdict(added['ttft_added_p99_ms'] <= 25)})"
    )
    print(
        f"ITL added: p50 {added['itl_added_p50_ms']:+.2f} ms (target <= 1: {verdict(added['itl_added_p50_ms'] <= 1)})"
    )
    cpu = cpu_ms_per_token(direct, stack)
    services = ", ".join(f"{name} {cpu[name]:.4f}" for name in SERVICES)
    others = {*SERVICES, "services", "direct engine"}
    beside = ", ".join(f"{name} {value:.4f}" for name, value in cpu.items() if name not in others)
    print(
        f"CPU ms per generated token: direct engine {cpu['direct engine']:.4f}; full stack: {services}, "
        f"the three services {cpu['services']:.4f} (target <= {CPU_TARGET_MS}: "
        f"{verdict(cpu['services'] <= CPU_TARGET_MS)}); beside them {beside}"
    )
    return {"direct": d, "stack": s, **added, "cpu_ms_per_token": cpu}


def cpu_ms_per_token(direct: Side, stack: Side) -> dict[str, float]:
    """CPU milliseconds per generated token of each side's processes, the three services summed."""

    def per_token(seconds: float, side: Side) -> float:
        tokens = side.figures()["tokens"]
        return seconds * 1000 / tokens if tokens else float("nan")

    cpu = {name: per_token(seconds, stack) for name, seconds in stack.cpu_s.items()}
    cpu["services"] = sum(cpu[name] for name in SERVICES)
    cpu["direct engine"] = per_token(direct.cpu_s["direct engine"], direct)
    return cpu


def add_load_arguments(
    parser: argparse.ArgumentParser,
    *,
    engines: tuple[str, ...] = ("sim", "transformers", "vllm"),
    other_streams: int = 16,
) -> None:
    """The load's options, shared by the scripts that drive the stack side this way
    (`load_settings` completes them once parsed): the engine, `--streams` (64 on the simulator,
    else `other_streams`), `--rounds`, `--max-tokens` and the simulator's timings."""
    parser.add_argument("--engine", choices=list(engines), default="sim")
    parser.add_argument("--streams", type=int, help=f"requests in flight (default: 64 sim, else {other_streams})")
    parser.add_argument("--rounds", type=int, default=3, help="requests per stream")
    parser.add_argument("--max-tokens", type=int, help="tokens per answer (default: 128 sim, else 64)")
    parser.add_argument("--sim-ttft-ms", type=float, default=50.0)
    parser.add_argument("--sim-itl-ms", type=float, default=20.0)


def load_settings(args: argparse.Namespace, *, other_streams: int = 16) -> None:
    """Fill in `add_load_arguments`' defaults that depend on the engine, and the model served."""
    args.streams = args.streams or (64 if args.engine == "sim" else other_streams)
    args.max_tokens = args.max_tokens or (128 if args.engine == "sim" else 64)
    args.model = "sim" if args.engine == "sim" else "SmolLM2-135M-Instruct"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_arguments(parser)
    parser.add_argument("--arrival", choices=["steady", "burst"], default="steady")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    load_settings(args)

    loop = loop_factory()
    with asyncio.Runner(loop_factory=loop) as runner:
        duration_s = runner.run(answer_duration_s(args))
        spacing_s = duration_s / args.streams if args.arrival == "steady" else 0.0
        print(f"one answer takes {duration_s:.2f} s; measuring the engine in-process...", file=sys.stderr, flush=True)
        direct = runner.run(measure_direct(args, spacing_s))
    with BenchEnvironment() as env:
        stack = env.start_stack(worker_env(args))
        key = env.create_key()
        print(f"platform ready (logs in {env.log_dir}); measuring through it...", file=sys.stderr, flush=True)
        with asyncio.Runner(loop_factory=loop) as runner:
            stacked = runner.run(measure_stack(args, stack["gateway"].url, key, spacing_s, stack_pids(stack)))
    figures = report(args, direct, stacked, spacing_s)
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": None}, **figures}, indent=2) + "\n")
    return 0 if figures["direct"]["errors"] == figures["stack"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
