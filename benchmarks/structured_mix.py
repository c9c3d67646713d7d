"""Structured requests on the simulator: a mix with 30 % tool-calling or JSON Schema requests keeps
the platform's capacity within 5 % of plain requests (issue 21).

    .venv/bin/python benchmarks/structured_mix.py                        # about 4 minutes
    .venv/bin/python benchmarks/structured_mix.py --concurrency 64 --requests 2000 --rounds 2

It starts its own worker (the `sim` engine at zero latency, as `capacity.py` does: the engine costs
nothing, so what is measured is the platform's own cost per request), session manager and gateway,
and drives the gateway with `axon bench` (its own process) at one concurrency, streamed, with two
prompts files of the same prompts:

- plain: chat requests, nothing else;
- mix: the same requests, three in every ten made structured: one `tool_choice: "required"` with
  two tools (the answer is tool calls, streamed as `delta.tool_calls`), one calling a tool named in
  `tool_choice` (finish `stop`), one with `response_format` `json_schema`. The worker derives a
  guide and a tool-call parser for each, the simulator writes schema-valid JSON, the session
  manager builds tool-call deltas.

The two workloads alternate for `--rounds` rounds, so a drift of the machine's speed touches both.
A structured answer ends (`stop`) when its JSON is complete, 28 pieces on average for these
schemas (at most 256); a plain one has `--tokens` words, 28 by default, so both workloads ask for
about as many tokens per request and requests/s compare like with like (the table shows tokens
per request). It prints, per run, requests/s, output tokens/s, errors, TTFT and end-to-end latency
and the CPU milliseconds each process spent per request; then each workload's capacity (its best
run with zero errors), each one's median over the rounds, and the ratio of the medians against
the target (mix / plain >= 0.95): the median is steadier than the best run when anything else
uses the machine.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from capacity import PROCESSES, best_clean_level, run_level, zero_latency_sim
from harness import BenchEnvironment, server_pids

TARGET_RATIO = 0.95
STRUCTURED_MAX_TOKENS = 256
# In every ten requests of the mix, these positions are structured (30 %).
STRUCTURED_SLOTS = {0: "required", 3: "named", 6: "json_schema"}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "An order's status.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "with_items": {"type": "boolean"}},
                "required": ["order_id", "with_items"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "rating", "tags"],
    "additionalProperties": False,
}
STRUCTURED_FIELDS = {
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}
    },
}


def prompts(count: int, *, mixed: bool) -> list[dict]:
    """`count` distinct chat requests; with `mixed`, three in ten carry tools or a schema."""
    lines = []
    for i in range(count):
        line: dict = {"messages": [{"role": "user", "content": f"Request {i}: where is order {i}?"}]}
        if mixed and (kind := STRUCTURED_SLOTS.get(i % 10)):
            # Room for the JSON to end on its own (`stop`), never cut at `length`.
            line.update(STRUCTURED_FIELDS[kind], max_tokens=STRUCTURED_MAX_TOKENS)
        lines.append(line)
    return lines


def write_prompts(folder: Path, name: str, lines: list[dict]) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# One run's figures: workload, round, req/s, tok/s, tokens per request, errors, TTFT p50 and p99,
# E2E p50 and p99 (ms), then the CPU milliseconds per request of each process and their total.
_ROW = "{:>8} {:>5} {:>8.1f} {:>8.0f} {:>7.1f} {:>6} {:>8.1f} {:>8.1f} {:>8.1f} {:>8.1f}   {:>19}"
_HEADER = "{:>8} {:>5} {:>8} {:>8} {:>7} {:>6} {:>8} {:>8} {:>8} {:>8}   {:>19}"


def print_runs(runs: list[tuple[str, int, dict]]) -> None:
    titles = ("workload", "round", "req/s", "tok/s", "tok/req", "errors", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99")
    print(_HEADER.format(*titles, "CPU ms per request:") + "".join(f" {p:>8}" for p in (*PROCESSES, "total")))
    for name, round_, level in runs:
        s = level["summary"]
        completed = max(1, s["requests"]["completed"])
        cpu_ms = {p: level["cpu_s"].get(p, 0.0) / completed * 1000 for p in PROCESSES}
        level["cpu_ms_per_request"] = cpu_ms
        figures = (s["request_throughput_rps"], s["output_token_throughput_tps"], s["total_output_tokens"] / completed)
        latency = (s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["e2e_ms"]["p50"], s["e2e_ms"]["p99"])
        cpu = "".join(f" {value:>8.2f}" for value in (*cpu_ms.values(), sum(cpu_ms.values())))
        print(_ROW.format(name, round_, *figures, s["requests"]["failed"], *latency, "") + cpu)
        for error in s["errors"]:
            print(f"{'':>8} error x{error['count']}: {error['message']}")


def capacity(runs: list[tuple[str, int, dict]], name: str) -> float | None:
    """A workload's best requests/s among its runs with zero errors."""
    best = best_clean_level([level for workload, _, level in runs if workload == name], "request_throughput_rps")
    return None if best is None else best["summary"]["request_throughput_rps"]


def median_rps(runs: list[tuple[str, int, dict]], name: str) -> float:
    """A workload's median requests/s over its rounds: on a machine something else also uses, the
    best run is whichever met a quiet moment; the median of alternating rounds is steadier."""
    values = sorted(level["summary"]["request_throughput_rps"] for workload, _, level in runs if workload == name)
    return values[len(values) // 2]


def median_cpu_ms(runs: list[tuple[str, int, dict]], name: str) -> float:
    """A workload's median CPU milliseconds per request, all processes together (less sensitive
    than requests/s to other load on the machine)."""
    totals = sorted(sum(level["cpu_ms_per_request"].values()) for workload, _, level in runs if workload == name)
    return totals[len(totals) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, meaning in (
        ("--concurrency", 128, "streams in flight"),
        ("--requests", 4000, "requests per run"),
        ("--tokens", 28, "words of a plain answer"),
        ("--rounds", 5, "runs of each workload, alternating"),
        ("--max-seqs", 512, "the sim worker's AXON_SIM_MAX_SEQS (prefetch)"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{meaning} (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()

    worker_env = zero_latency_sim(args.max_seqs)
    folder = Path(tempfile.mkdtemp(prefix="axon-structured-mix-"))
    files = {
        "plain": write_prompts(folder, "plain", prompts(args.requests, mixed=False)),
        "mix": write_prompts(folder, "mix", prompts(args.requests, mixed=True)),
    }
    runs: list[tuple[str, int, dict]] = []
    with BenchEnvironment() as env:
        stack = env.start_stack(worker_env)
        key = env.create_key()
        pids = {name: [process.pid] for name, process in stack.items()} | server_pids()
        print(f"stack ready (logs in {env.log_dir}); {os.cpu_count()} CPUs", file=sys.stderr, flush=True)
        for round_ in range(1, args.rounds + 1):
            for name, path in files.items():
                print(f"round {round_}: {name}...", file=sys.stderr, flush=True)
                level = run_level(
                    env,
                    stack["gateway"].url,
                    key,
                    pids,
                    concurrency=args.concurrency,
                    requests=args.requests,
                    output_tokens=args.tokens,
                    warmup=min(200, args.requests // 10),
                    bench_args=["--prompts-file", str(path)],
                )
                runs.append((name, round_, level))
    print(
        f"\nsim at zero latency, {args.concurrency} streams, {args.requests} requests per run, "
        f"{args.tokens}-token answers, streamed; mix = 30 % structured (10 % tool_choice required, "
        f"10 % named tool, 10 % json_schema); {os.cpu_count()} CPUs"
    )
    print_runs(runs)
    plain, mix = capacity(runs, "plain"), capacity(runs, "mix")
    result: dict = {"date": time.strftime("%Y-%m-%d"), "config": vars(args) | {"json": None}, "runs": runs}
    if plain is None or mix is None:
        print("a workload had no run without errors")
        status = 1
    else:
        typical = {name: median_rps(runs, name) for name in files}
        ratio = typical["mix"] / typical["plain"]
        verdict = "ok" if ratio >= TARGET_RATIO else "MISSED"
        cpu = {name: median_cpu_ms(runs, name) for name in files}
        print(f"capacity (best run): plain {plain:.1f} req/s, mix {mix:.1f} req/s, mix/plain {mix / plain:.3f}")
        print(f"median of rounds: plain {typical['plain']:.1f} req/s, mix {typical['mix']:.1f} req/s")
        print(f"mix/plain (medians) = {ratio:.3f} (target >= {TARGET_RATIO}: {verdict})")
        print(
            f"CPU per request (median of rounds, every process): plain {cpu['plain']:.2f} ms, "
            f"mix {cpu['mix']:.2f} ms (mix/plain {cpu['mix'] / cpu['plain']:.3f})"
        )
        result |= {"best_rps": {"plain": plain, "mix": mix}, "median_rps": typical, "ratio": ratio, "cpu_ms": cpu}
        status = 0
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
