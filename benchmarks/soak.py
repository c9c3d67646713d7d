"""Soak: steady load for a long time; zero errors, and every process's memory stays flat.

    .venv/bin/python benchmarks/soak.py                        # 10 minutes at 260 req/s
    .venv/bin/python benchmarks/soak.py --minutes 1            # the variant CI runs

It starts its own worker (the `sim` engine at near-zero latency, as `capacity.py` measures),
session manager and gateway, with a database and Redis namespace of their own (removed at the
end), and drives the gateway with `axon bench` (its own process) at `--rate` streamed requests per
second with Poisson arrivals. The default, 260, is about 70% of the capacity `capacity.py`
measured on the development machine on its slowest day; for a soak at 70% of this machine, run
`capacity.py` first and pass 0.7 x its requests/s as `--rate` (benchmarks/RESULTS.md). Every 5 s
it records the resident memory (RSS) of the gateway, the session manager and the worker.

It fails (exit 1) if any request failed, or if a process's RSS at the end is 10% or more above
its RSS at the end of the warm-up (the first fifth of the run, at most a minute). With `--json`
it writes every figure and the memory samples.
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

from harness import BenchEnvironment

MODEL = "sim"
SAMPLE_EVERY_S = 5.0


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
    parser.add_argument("--rate", type=float, default=260.0, help="streamed requests per second (Poisson)")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-growth", type=float, default=0.10, help="allowed RSS growth after warm-up")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    duration_s = args.minutes * 60
    warmup_s = min(60.0, duration_s / 5)
    worker_env = {
        "AXON_ENGINE": "sim", "AXON_MODEL": MODEL, "AXON_SIM_TTFT_MS": "0", "AXON_SIM_ITL_MS": "0",
        "AXON_SIM_MAX_SEQS": "512",
    }  # fmt: skip
    with BenchEnvironment() as env:
        stack = env.start_stack(worker_env)
        key = env.create_key()
        sampler = MemorySampler({name: process.pid for name, process in stack.items()})
        print(f"soak: {args.rate:g} req/s for {args.minutes:g} min (logs in {env.log_dir})", file=sys.stderr, flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            argv = [
                sys.executable, "-m", "services.cli.main", "bench", "--base-url", f"{stack['gateway'].url}/v1",
                "--model", MODEL, "--num-requests", str(int(args.rate * duration_s)), "--request-rate", str(args.rate),
                "--input-len", "16", "--output-len", str(args.output_len), "--no-progress", "--json", out.name,
            ]  # fmt: skip
            sampler.start()
            subprocess.run(argv, env={**os.environ, "OPENAI_API_KEY": key}, stdout=subprocess.DEVNULL, check=False)
            sampler.stopping.set()
            sampler.join()
            summary = json.loads(Path(out.name).read_text())

    elapsed_s = sampler.samples[-1]["t_s"]
    after_warmup, last = sampler.at(warmup_s), sampler.samples[-1]
    growth = {name: last[name] / after_warmup[name] - 1 for name in sampler.pids}
    failed = summary["requests"]["failed"]
    print(f"\nsoak: {summary['requests']['completed']} requests completed, {failed} failed in {summary['duration_s']:.0f} s "
          f"({summary['request_throughput_rps']:.1f} req/s); TTFT p50 {summary['ttft_ms']['p50']:.1f} ms, "
          f"p99 {summary['ttft_ms']['p99']:.1f} ms")  # fmt: skip
    for error in summary["errors"]:
        print(f"  error x{error['count']}: {error['message']}")
    print(f"resident memory after the warm-up ({after_warmup['t_s']:g} s) and at the end ({elapsed_s:g} s):")
    for name in sampler.pids:
        print(f"  {name:<9} {after_warmup[name] / 2**20:7.1f} MiB -> {last[name] / 2**20:7.1f} MiB  "
              f"({growth[name] * 100:+.1f}%, limit +{args.max_growth * 100:g}%)")  # fmt: skip
    flat = all(g < args.max_growth for g in growth.values())
    print(f"verdict: {'ok' if failed == 0 and flat else 'FAILED'} (zero errors: {failed == 0}, memory flat: {flat})")
    if args.json:
        args.json.write_text(json.dumps(
            {"config": vars(args) | {"json": None}, "bench": summary, "rss_samples": sampler.samples, "growth": growth},
            indent=2, default=str,
        ) + "\n")  # fmt: skip
    return 0 if failed == 0 and flat else 1


if __name__ == "__main__":
    sys.exit(main())
