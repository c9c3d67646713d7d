"""Session affinity on vLLM's real prefix cache: `affinity.py`'s workload against two vLLM workers of one
core each (the bundled SmolLM2): routing on the prefix index, session affinity alone, neither.

    .venv/bin/python benchmarks/affinity_vllm.py             # about 12 minutes on 2 cores

Two workers on the vLLM engine (`AXON_CPU_THREADS_BIND` 0 and 1: one core each), and three session
managers with a gateway each: `index` (`AXON_AFFINITY_WAIT_MS=250` and the prefix index, the
default: a turn goes where its prefix is cached, else to the worker that served its session's
last turn), `affinity on` (the same without the index, `AXON_PREFIX_ROUTING=false`: the rule
before it) and `affinity off` (neither: every turn to the model's shared queue, so to either
worker). After a warm-up (`--active` sessions of two turns, not measured), a phase of
`--sessions` sessions x `--turns` turns over the public API per session manager (`session_id`,
streamed, usage included), each phase in words of its own, in that order.
`--active` sessions are in progress at once, each sending its next turn as soon as its last one
ended (a closed loop: the workers are kept busy). A conversation is `affinity.py`'s (a 50-word
system prompt, per turn a user message and an answer of `max_tokens` tokens), shortened by
`--scale` for a CPU.

Printed per phase: turns, turns lost, cached prompt tokens / prompt tokens (vLLM's
`cached_tokens`: whole 128-token blocks found in the worker's prefix cache; all turns, and turns
after the first), time to first token p50 / p99, end-to-end p50 / p99 and turns/s; then index /
affinity on and affinity on / off.
"""

import argparse
import asyncio
import os
import sys
import time

from affinity import Conversation, report, run_phase, workload
from harness import BenchEnvironment, start_service_pair, start_vllm_workers_per_core

from services.worker.engines.vllm_config import cpu_dtype, cpu_flags

MODEL = "affinity-vllm"
WARMUP_SEED = 99


def scaled(conversations: list[Conversation], scale: float) -> list[Conversation]:
    """The conversations with user messages and answers `scale` times as long."""
    for conversation in conversations:
        conversation.turns = [
            (" ".join(message.split()[: max(1, int(len(message.split()) * scale))]), max(1, int(tokens * scale)))
            for message, tokens in conversation.turns
        ]
    return conversations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--active", type=int, default=8, help="sessions in progress at once")
    parser.add_argument("--scale", type=float, default=0.25, help="length of messages and answers vs affinity.py")
    parser.add_argument("--affinity-wait-ms", type=int, default=250, help="AXON_AFFINITY_WAIT_MS when on")
    args = parser.parse_args()
    # Each phase's session manager: its settings, and the seed of its workload (words of its own).
    phases = {
        "index": ({"AXON_AFFINITY_WAIT_MS": str(args.affinity_wait_ms)}, 3),
        "affinity on": ({"AXON_AFFINITY_WAIT_MS": str(args.affinity_wait_ms), "AXON_PREFIX_ROUTING": "false"}, 1),
        "affinity off": ({"AXON_AFFINITY_WAIT_MS": "0", "AXON_PREFIX_ROUTING": "false"}, 2),
    }
    dtype = "float32" if cpu_dtype("auto", cpu_flags()) == "float32" else "bfloat16"
    loads = {name: scaled(workload(seed, args.sessions, args.turns), args.scale) for name, (_, seed) in phases.items()}
    results = {}
    with BenchEnvironment() as env:
        env.models.add(MODEL)
        start_vllm_workers_per_core(env, MODEL, label="vllm")
        gateways = {
            name: start_service_pair(env, name.replace(" ", "-"), settings) for name, (settings, _) in phases.items()
        }
        key = env.create_key()
        print(f"stack ready (logs in {env.log_dir}); {os.cpu_count()} CPUs", file=sys.stderr, flush=True)

        def phase(gateway: str, load: list[Conversation], seed: int) -> dict:
            return asyncio.run(
                run_phase(
                    gateways[gateway].url,
                    key,
                    load,
                    sim_ttft=lambda _turn: float("nan"),
                    rate=1000.0,  # arrivals far faster than answers: each session's next turn at once
                    active=args.active,
                    seed=seed,
                    model=MODEL,
                )
            )

        # Not measured: the workers' first requests (vLLM's first batches of each size are slower),
        # so that no phase pays for them.
        print("warm-up...", file=sys.stderr, flush=True)
        phase("affinity off", scaled(workload(WARMUP_SEED, args.active, 2), args.scale), WARMUP_SEED)
        for name in phases:
            print(f"{name}...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            results[name] = phase(name, loads[name], phases[name][1])
            print(f"  {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(
        f"\n2 vLLM workers x 1 core (the bundled SmolLM2, {dtype}, eager); {args.sessions} sessions x {args.turns} "
        f"turns per phase, {args.active} in progress at once, messages and answers x {args.scale:g} of affinity.py's"
    )
    print(
        f"{'phase':<14} {'turns':>6} {'lost':>5} {'deferred':>8} {'hit ratio':>9} {'(turns 2+)':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'':>8} {'':>8} {'e2e p50':>8} {'e2e p99':>8} {'turns/s':>9}"
    )
    for name, result in results.items():
        report(name, result)
    for a, b in (("index", "affinity on"), ("affinity on", "affinity off")):
        first, second = results[a], results[b]
        p50, p99 = (first["ttft_ms"][q] / second["ttft_ms"][q] for q in ("p50", "p99"))
        print(
            f"{a} / {b}: hit ratio {first['hit_ratio'] / second['hit_ratio']:.2f} x, TTFT p50 {p50:.2f} x, "
            f"p99 {p99:.2f} x, turns/s {first['throughput'] / second['throughput']:.2f} x"
        )
    return 0 if all(result["lost"] == 0 for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
