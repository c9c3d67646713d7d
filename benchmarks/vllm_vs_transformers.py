"""The whole platform on vLLM against the whole platform on the transformers engine, in one run: one
gateway and session manager, one worker of each engine (the bundled SmolLM2 under two model names),
the same client and requests.

    .venv/bin/python benchmarks/vllm_vs_transformers.py            # 1 and 16 streams, ~8 min

For each concurrency, `--repeats` rounds alternate which engine goes first; the other's worker
idles meanwhile (its CPU is printed). Each stream is a closed loop of `--requests` chat requests of
`--max-tokens` tokens (`ignore_eos`, greedy). Figures: output tokens/s and time to first token
p50, then vLLM / transformers throughput (expected from the trial: >= 2 x at one stream, >= 3 x at
16). Both engines run with their defaults (vLLM: bfloat16, or float32 on a CPU without bfloat16
arithmetic, eager, a 1 GiB KV cache; transformers: float32, its continuous batching).
"""

import argparse
import asyncio
import sys
import time

from harness import BenchEnvironment, cpu_seconds, loop_factory
from vllm_serve_vs_stack import measure, pooled

from services.worker.engines.gguf import bundled_gguf_path

MODELS = {"vllm": "smollm2-vllm-bench", "transformers": "smollm2-transformers-bench"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, default=3, help="requests per stream and round")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    max_seqs = str(max(args.streams))
    rows = []
    with BenchEnvironment() as env:
        workers = {}
        for engine, model in MODELS.items():
            env.models.add(model)
            workers[engine] = env.start_service(
                "worker",
                name=f"worker-{engine}",
                env={
                    "AXON_ENGINE": engine,
                    "AXON_MODEL": model,
                    "AXON_MODEL_PATH": str(bundled_gguf_path()),
                    "AXON_MAX_SEQS": max_seqs,
                },
                ready_timeout_s=600,
            )
        sessions = env.start_service("sessions")
        gateway = env.start_service("gateway", env={"AXON_SESSIONS_URL": sessions.url})
        key = env.create_key()
        print(f"platform ready (logs in {env.log_dir}); measuring...", file=sys.stderr, flush=True)
        loop = loop_factory()
        with asyncio.Runner(loop_factory=loop) as runner:
            for streams in args.streams:
                sides: dict[str, list] = {engine: [] for engine in MODELS}
                idle: dict[str, float] = dict.fromkeys(MODELS, 0.0)
                for repeat in range(args.repeats):
                    order = list(MODELS) if repeat % 2 == 0 else list(reversed(MODELS))
                    for engine in order:
                        other = next(e for e in MODELS if e != engine)
                        before = cpu_seconds(workers[other].process.pid) or 0.0
                        started = time.perf_counter()
                        side = runner.run(
                            measure(
                                gateway.url,
                                key,
                                streams=streams,
                                requests=args.requests,
                                max_tokens=args.max_tokens,
                                spacing_s=0,
                                model=MODELS[engine],
                            )
                        )
                        idle[other] += (cpu_seconds(workers[other].process.pid) or 0.0) - before
                        sides[engine].append(side)
                        print(
                            f"  {streams:>3} streams, round {repeat + 1}, {engine:<12}: "
                            f"{side.figures()['output_tok_s']:7.1f} tok/s ({time.perf_counter() - started:.0f} s)",
                            file=sys.stderr,
                            flush=True,
                        )
                rows.append((streams, pooled(sides["vllm"]), pooled(sides["transformers"]), idle))
    print(
        f"\nWhole platform, chat streams of {args.max_tokens} tokens (ignore_eos, greedy), {args.requests} requests a "
        f"stream, {args.repeats} rounds pooled; the bundled SmolLM2 on each engine's defaults"
    )
    print(
        f"{'streams':>7} | {'vllm tok/s':>10} {'TTFT p50':>9} | {'transformers tok/s':>18} {'TTFT p50':>9} | "
        f"{'vllm / transformers':>19} | idle worker CPU s (vllm, transformers)"
    )
    for streams, v, t, idle in rows:
        ratio = v["output_tok_s"] / t["output_tok_s"] if t["output_tok_s"] else float("nan")
        print(
            f"{streams:>7} | {v['output_tok_s']:>10.1f} {v['ttft_p50_ms']:>7.0f}ms | {t['output_tok_s']:>18.1f} "
            f"{t['ttft_p50_ms']:>7.0f}ms | {ratio:>19.2f} | {idle['vllm']:.1f}, {idle['transformers']:.1f}"
        )
    return 0 if all(v["errors"] == t["errors"] == 0 for _, v, t, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
