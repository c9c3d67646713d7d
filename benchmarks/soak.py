"""Soak: steady load for a long time; zero errors, and every process's memory stays flat.

    .venv/bin/python benchmarks/soak.py                        # 10 minutes at 70% of capacity
    .venv/bin/python benchmarks/soak.py --minutes 1            # the variant CI runs
    .venv/bin/python benchmarks/soak.py --rate 1000 --minutes 2 --expect-overload

It starts its own worker (the `sim` engine at near-zero latency, as `capacity.py` measures),
session manager and gateway, with a database and Redis namespace of their own (removed at the
end). First it measures the capacity of that stack, as `capacity.py --workload requests` does
(16-token streamed answers at 64, 128 and 256 streams in flight; the best level with zero
errors), because this VM's speed varies by a factor of 2-3 from day to day. Then it drives the
gateway with `axon bench` (its own process) at `--fraction` (0.7) of that capacity, or at
`--rate`, in streamed requests per second with Poisson arrivals, with at most as many in flight
as the best capacity level held without an error: a capacity measured while the machine was quiet
is more than the stack sustains once other processes take the cores, and open-loop arrivals would
then pile up until requests are refused (503 `overloaded` past `AXON_MAX_REQUESTS_IN_FLIGHT` at
the latest); with the bound, a slower stack makes arrivals wait at the client, as a client's
connection pool would. (With `--rate`, the bound is the most streams the capacity levels use.) Every
5 s it records the resident memory (RSS) of the gateway, the session manager and the worker.

It fails (exit 1) if any request failed, or if a process's RSS at the end is 10% or more above
its RSS at the end of the warm-up (the first fifth of the run, at most a minute). With `--json`
it writes every figure and the memory samples.

With `--expect-overload` (a rate above capacity, no bound on what is in flight) errors are
expected: it fails instead if any error is not a 503 `overloaded` refusal from the gateway, or if
memory grows.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from capacity import best_clean_level, run_level
from harness import BenchEnvironment

from services.gateway.proxy import OVERLOADED_MESSAGE

MODEL = "sim"
SAMPLE_EVERY_S = 5.0
CAPACITY_STREAMS = (64, 128, 256)
CAPACITY_REQUESTS = 3000
OVERLOADED = f"HTTP 503: {OVERLOADED_MESSAGE}"  # as `axon bench` reports the gateway's refusal


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for {pid}")


class MemorySampler(threading.Thread):
    """Samples the RSS of some processes every `SAMPLE_EVERY_S` until stopped."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.samples: list[dict] = []
        self.stopping = threading.Event()
        self.started_at = time.monotonic()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.samples.append(
                {"t_s": round(time.monotonic() - self.started_at, 1)} | {n: rss_bytes(p) for n, p in self.pids.items()}
            )
            self.stopping.wait(SAMPLE_EVERY_S)

    def at(self, moment_s: float) -> dict:
        """The last sample taken at or before `moment_s` into the run."""
        return [s for s in self.samples if s["t_s"] <= moment_s][-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, help="streamed requests per second (Poisson); default: --fraction")
    parser.add_argument("--fraction", type=float, default=0.7, help="of the capacity measured first")
    parser.add_argument("--expect-overload", action="store_true", help="only 503 overloaded refusals are allowed")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-growth", type=float, default=0.10, help="allowed RSS growth after warm-up")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    duration_s = args.minutes * 60
    warmup_s = min(60.0, duration_s / 5)
    worker_env = {
        "AXON_ENGINE": "sim",
        "AXON_MODEL": MODEL,
        "AXON_SIM_TTFT_MS": "0",
        "AXON_SIM_ITL_MS": "0",
        "AXON_SIM_MAX_SEQS": "512",
    }
    with BenchEnvironment() as env:
        stack = env.start_stack(worker_env)
        key = env.create_key()
        capacity_rps = None
        in_flight = max(CAPACITY_STREAMS)
        if args.rate is None:
            capacity_rps, in_flight = measure_capacity(
                env, stack["gateway"].url, key, {n: [p.pid] for n, p in stack.items()}
            )
            args.rate = round(args.fraction * capacity_rps, 1)
            print(
                f"capacity: {capacity_rps:.1f} req/s (best of {', '.join(map(str, CAPACITY_STREAMS))} streams in "
                f"flight, zero errors); soaking at {args.fraction:g} x that, at most {in_flight} in flight",
                flush=True,
            )
        sampler = MemorySampler({name: process.pid for name, process in stack.items()})
        print(
            f"soak: {args.rate:g} req/s for {args.minutes:g} min (logs in {env.log_dir})", file=sys.stderr, flush=True
        )
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            argv = [
                sys.executable,
                "-m",
                "services.cli.main",
                "bench",
                "--base-url",
                f"{stack['gateway'].url}/v1",
                "--model",
                MODEL,
                "--num-requests",
                str(int(args.rate * duration_s)),
                "--request-rate",
                str(args.rate),
                "--input-len",
                "16",
                "--output-len",
                str(args.output_len),
                "--no-progress",
                "--json",
                out.name,
            ]
            if not args.expect_overload:
                argv += ["--max-concurrency", str(in_flight)]
            sampler.start()
            subprocess.run(argv, env={**os.environ, "OPENAI_API_KEY": key}, stdout=subprocess.DEVNULL, check=False)
            sampler.stopping.set()
            sampler.join()
            summary = json.loads(Path(out.name).read_text())

    elapsed_s = sampler.samples[-1]["t_s"]
    after_warmup, last = sampler.at(warmup_s), sampler.samples[-1]
    growth = {name: last[name] / after_warmup[name] - 1 for name in sampler.pids}
    failed = summary["requests"]["failed"]
    unexpected = sum(e["count"] for e in summary["errors"] if not (args.expect_overload and e["message"] == OVERLOADED))
    print(
        f"\nsoak: {args.rate:g} req/s offered for {args.minutes:g} min; {summary['requests']['completed']} requests "
        f"completed, {failed} failed in {summary['duration_s']:.0f} s ({summary['request_throughput_rps']:.1f} req/s "
        f"completed); TTFT p50 {summary['ttft_ms']['p50']:.1f} ms, p99 {summary['ttft_ms']['p99']:.1f} ms"
    )
    for error in summary["errors"]:
        print(f"  error x{error['count']}: {error['message']}")
    print(f"resident memory after the warm-up ({after_warmup['t_s']:g} s) and at the end ({elapsed_s:g} s):")
    for name in sampler.pids:
        print(
            f"  {name:<9} {after_warmup[name] / 2**20:7.1f} MiB -> {last[name] / 2**20:7.1f} MiB  "
            f"({growth[name] * 100:+.1f}%, limit +{args.max_growth * 100:g}%)"
        )
    flat = all(g < args.max_growth for g in growth.values())
    allowed = "only overload refusals" if args.expect_overload else "zero errors"
    print(
        f"verdict: {'ok' if unexpected == 0 and flat else 'FAILED'} ({allowed}: {unexpected == 0}, memory flat: {flat})"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "config": vars(args) | {"json": None},
                    "capacity_rps": capacity_rps,
                    "bench": summary,
                    "rss_samples": sampler.samples,
                    "growth": growth,
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
    return 0 if unexpected == 0 and flat else 1


def measure_capacity(
    env: BenchEnvironment, gateway_url: str, key: str, pids: dict[str, list[int]]
) -> tuple[float, int]:
    """The most streamed requests/s the stack completed with zero errors at any of `CAPACITY_STREAMS`,
    and the streams in flight of that level.

    Raises:
        RuntimeError: every level had errors.
    """
    levels = []
    for streams in CAPACITY_STREAMS:
        print(f"capacity: {streams} streams...", file=sys.stderr, flush=True)
        levels.append(
            run_level(
                env,
                gateway_url,
                key,
                pids,
                concurrency=streams,
                requests=CAPACITY_REQUESTS,
                output_tokens=16,
                warmup=200,
            )
        )
        summary = levels[-1]["summary"]
        print(
            f"capacity: {streams:>4} streams {summary['request_throughput_rps']:7.1f} req/s, "
            f"{summary['requests']['failed']} errors",
            flush=True,
        )
    best = best_clean_level(levels, "request_throughput_rps")
    if best is None:
        raise RuntimeError("no capacity level ran without errors")
    return best["summary"]["request_throughput_rps"], best["concurrency"]


if __name__ == "__main__":
    sys.exit(main())
