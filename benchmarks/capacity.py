"""Capacity: the most the full stack sustains on this machine with zero errors, and the CPU each
process spends on it.

    .venv/bin/python benchmarks/capacity.py                          # about 3 minutes
    .venv/bin/python benchmarks/capacity.py --workload requests --concurrency 64 128 --requests 6000

It starts its own worker (the `sim` engine at near-zero latency: AXON_SIM_TTFT_MS=0,
AXON_SIM_ITL_MS=0), session manager and gateway, with a database and Redis namespace of their own
(removed at the end), and drives the gateway with `axon bench` (its own process) at each
concurrency level, streamed, for two workloads:

- requests: 16-token answers (`--short-tokens`), what limits requests per second;
- tokens: long answers (`--long-tokens`, default 1024), what limits output tokens per second.

For every level it prints requests/s, output tokens/s, errors, TTFT and end-to-end latency, and
the CPU seconds each process spent per 1,000 output tokens (and per request): gateway, session
manager, worker, Redis, RabbitMQ, PostgreSQL, and the load generator itself, which shares the
machine. The capacity of a workload is its best level with zero errors.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from harness import BenchEnvironment, CpuMeter, server_pids

MODEL = "sim"
# Words in each synthetic prompt `run_level` sends.
INPUT_LEN = 16
PROCESSES = ("gateway", "sessions", "worker", "redis", "rabbitmq", "postgres", "client")


def zero_latency_sim(max_seqs: int) -> dict[str, str]:
    """The worker's environment: the `sim` engine with every token due at once (it costs
    nothing, so the platform's own cost is what is measured)."""
    return {
        "AXON_ENGINE": "sim",
        "AXON_MODEL": MODEL,
        "AXON_SIM_TTFT_MS": "0",
        "AXON_SIM_ITL_MS": "0",
        "AXON_SIM_MAX_SEQS": str(max_seqs),
    }


def run_level(
    env: BenchEnvironment,
    gateway_url: str,
    key: str,
    pids: dict[str, list[int]],
    *,
    concurrency: int,
    requests: int,
    output_tokens: int,
    warmup: int,
    bench_args: Sequence[str] = (),
) -> dict:
    """One `axon bench` run (`bench_args`: more of its options, e.g. `--prompts-file`); its summary
    plus the CPU every process spent during it."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [
            sys.executable,
            "-m",
            "services.cli.main",
            "bench",
            "--base-url",
            f"{gateway_url}/v1",
            "--model",
            MODEL,
            "--num-requests",
            str(requests),
            "--max-concurrency",
            str(concurrency),
            "--input-len",
            str(INPUT_LEN),
            "--output-len",
            str(output_tokens),
            "--warmup",
            str(warmup),
            "--no-progress",
            "--json",
            out.name,
            *bench_args,
        ]
        meter = CpuMeter(pids)
        meter.start()
        client = subprocess.Popen(argv, env={**os.environ, "AXON_API_KEY": key}, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(client.pid, 0)
        client.returncode = os.waitstatus_to_exitcode(status)
        cpu = meter.stop()
        summary = json.loads(Path(out.name).read_text())
    # The client's CPU includes its warm-up and start-up: a slight overstatement of its share.
    cpu["client"] = usage.ru_utime + usage.ru_stime
    return {"concurrency": concurrency, "summary": summary, "cpu_s": cpu}


def best_clean_level(levels: list[dict], figure: str) -> dict | None:
    """The level with the highest `figure` of its summary among those with zero errors: a
    workload's capacity."""
    clean = [level for level in levels if level["summary"]["requests"]["failed"] == 0]
    return max(clean, key=lambda level: level["summary"][figure], default=None)


def report(workload: str, levels: list[dict]) -> dict:
    print(f"\n{workload}: {levels[0]['summary']['config']['output_len']}-token answers, streamed")
    print(
        f"{'streams':>8} {'req/s':>8} {'tok/s':>9} {'errors':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>8} "
        f"{'E2E p99':>8}   CPU s per 1,000 tokens: " + " ".join(f"{p:>8}" for p in PROCESSES) + f" {'total':>7}"
    )
    for level in levels:
        s = level["summary"]
        tokens = max(1, s["total_output_tokens"])
        per_k = {p: level["cpu_s"].get(p, 0.0) / tokens * 1000 for p in PROCESSES}
        level["cpu_s_per_1k_tokens"] = per_k
        level["cpu_ms_per_request"] = {
            p: level["cpu_s"].get(p, 0.0) / max(1, s["requests"]["completed"]) * 1000 for p in PROCESSES
        }
        print(
            f"{level['concurrency']:>8} {s['request_throughput_rps']:>8.1f} {s['output_token_throughput_tps']:>9.0f} "
            f"{s['requests']['failed']:>7} {s['ttft_ms']['p50']:>9.1f} {s['ttft_ms']['p99']:>9.1f} "
            f"{s['e2e_ms']['p50']:>8.1f} {s['e2e_ms']['p99']:>8.1f}   {'':>23}"
            + " ".join(f"{per_k[p]:>8.3f}" for p in PROCESSES)
            + f" {sum(per_k.values()):>7.3f}"
        )
        for error in s["errors"]:
            print(f"{'':>8} error x{error['count']}: {error['message']}")
    best_rps = best_clean_level(levels, "request_throughput_rps")
    best_tps = best_clean_level(levels, "output_token_throughput_tps")
    if best_rps is None or best_tps is None:
        print("no level ran without errors")
        return {"levels": levels}
    print(
        f"capacity with zero errors: {best_rps['summary']['request_throughput_rps']:.1f} req/s "
        f"({best_rps['concurrency']} streams), {best_tps['summary']['output_token_throughput_tps']:.0f} output tok/s "
        f"({best_tps['concurrency']} streams)"
    )
    cpu_ms = best_rps["cpu_ms_per_request"]
    print(
        "CPU ms per request at that level: "
        + ", ".join(f"{p} {cpu_ms[p]:.2f}" for p in PROCESSES)
        + f", total {sum(cpu_ms.values()):.2f}"
    )
    return {
        "levels": levels,
        "best_rps": best_rps["summary"]["request_throughput_rps"],
        "best_tps": best_tps["summary"]["output_token_throughput_tps"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["requests", "tokens", "both"], default="both")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64, 128, 256], help="streams in flight")
    parser.add_argument("--requests", type=int, default=4000, help="requests per level (16-token answers)")
    parser.add_argument("--long-requests", type=int, default=600, help="requests per level (long answers)")
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=1024)
    parser.add_argument("--max-seqs", type=int, default=512, help="the sim worker's AXON_SIM_MAX_SEQS (prefetch)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()

    worker_env = zero_latency_sim(args.max_seqs)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "config": vars(args) | {"json": None}}
    with BenchEnvironment() as env:
        stack = env.start_stack(worker_env)
        key = env.create_key()
        pids = {name: [process.pid] for name, process in stack.items()} | server_pids()
        print(f"stack ready (logs in {env.log_dir}); {os.cpu_count()} CPUs", file=sys.stderr, flush=True)
        workloads = {"requests": (args.short_tokens, args.requests), "tokens": (args.long_tokens, args.long_requests)}
        for name, (tokens, requests) in workloads.items():
            if args.workload not in (name, "both"):
                continue
            levels = []
            for concurrency in args.concurrency:
                print(f"{name}: {concurrency} streams...", file=sys.stderr, flush=True)
                levels.append(
                    run_level(
                        env,
                        stack["gateway"].url,
                        key,
                        pids,
                        concurrency=concurrency,
                        requests=requests,
                        output_tokens=tokens,
                        warmup=min(200, requests // 10),
                    )
                )
            results[name] = report(name, levels)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
