"""vLLM on the CPU: what the engine's defaults were chosen from. For each configuration the vLLM
engine (Axon's, with the bundled SmolLM2) starts in a process of its own, then answers 128-token
greedy requests (`ignore_eos`) one at a time and 16 at once.

    .venv/bin/python benchmarks/vllm_cpu_settings.py                  # eager/compiled x bf16/fp32, ~8 minutes
    .venv/bin/python benchmarks/vllm_cpu_settings.py --configs eager-bfloat16 compiled-bfloat16

Printed per configuration: seconds from the engine's start to ready (loading and, compiled,
torch.compile's work; the Python imports of the process are not counted), and output tokens/s at
1 and 16 streams (the best of `--repeats` rounds each). A configuration named twice runs twice
(one row each, in the order named), so the table shows how far two runs of one differ.
"""

import argparse
import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

from services.worker.engines.base import GenerationRequest
from services.worker.engines.gguf import bundled_gguf_path, default_model_cache_dir
from services.worker.engines.vllm_config import VllmOptions
from services.worker.engines.vllm_engine import VllmEngine
from shared.schemas import Message, Sampling

CONFIGS = ["eager-bfloat16", "compiled-bfloat16", "eager-float32", "compiled-float32"]


async def answer(engine: VllmEngine, i: int, max_tokens: int) -> int:
    request = GenerationRequest(
        request_id=str(uuid.uuid4()),
        sampling=Sampling(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        messages=[Message(role="user", content=f"Write a long story about the number {i}.")],
    )
    tokens = 0
    async for out in engine.generate(request):
        tokens = out.completion_tokens
    return tokens


async def measure(config: str, repeats: int, max_tokens: int) -> dict[str, float]:
    mode, dtype = config.split("-")
    options = VllmOptions(
        model_name="smollm2", model_path=str(bundled_gguf_path()), dtype=dtype, enforce_eager=mode == "eager"
    )
    engine = VllmEngine(options, model_cache_dir=default_model_cache_dir())
    started = time.perf_counter()
    await engine.start()
    figures = {"start_s": time.perf_counter() - started}
    try:
        await answer(engine, 0, 8)  # warm-up
        for streams in (1, 16):
            best = 0.0
            for _ in range(repeats):
                began = time.perf_counter()
                tokens = await asyncio.gather(*(answer(engine, i, max_tokens) for i in range(streams)))
                best = max(best, sum(tokens) / (time.perf_counter() - began))
            figures[f"tok_s_{streams}"] = best
    finally:
        await engine.stop()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one configuration, print its figures
    args = parser.parse_args()
    if args.one:
        print(json.dumps(asyncio.run(measure(args.one, args.repeats, args.max_tokens))))
        return 0
    rows = []  # one per run: a configuration named twice shows how far its runs differ
    for config in args.configs:
        print(f"{config}...", file=sys.stderr, flush=True)
        argv = [sys.executable, str(Path(__file__)), "--one", config, "--repeats", str(args.repeats)]
        out = subprocess.run([*argv, "--max-tokens", str(args.max_tokens)], capture_output=True, text=True, check=True)
        rows.append((config, json.loads(out.stdout.strip().splitlines()[-1])))
    print(
        f"\nvLLM engine on the CPU, the bundled SmolLM2; {args.max_tokens}-token greedy answers, best of {args.repeats}"
    )
    print(f"{'configuration':<18} {'start s':>8} {'1 stream tok/s':>15} {'16 streams tok/s':>17}")
    for config, f in rows:
        print(f"{config:<18} {f['start_s']:>8.1f} {f['tok_s_1']:>15.1f} {f['tok_s_16']:>17.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
