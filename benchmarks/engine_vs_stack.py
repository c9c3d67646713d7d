"""Time to first token, inter-token latency and output tokens/s: the engine driven directly
in this process, then the same engine class behind the whole platform (gateway -> session
manager -> RabbitMQ -> worker -> Redis -> back), at each concurrency level, in one run so the
ratios compare.

CPU engine, against a platform started with `make up` (it prints AXON_API_KEY):

    AXON_API_KEY=axk_... .venv/bin/python benchmarks/engine_vs_stack.py --concurrency 1 16

Simulator, against a platform whose worker runs `AXON_ENGINE=sim AXON_SIM_ITL_MS=20
AXON_SIM_TTFT_MS=50 AXON_MODEL=sim` (the same values are passed here):

    AXON_API_KEY=axk_... .venv/bin/python benchmarks/engine_vs_stack.py --engine sim \
        --model sim --sim-ttft-ms 50 --sim-itl-ms 20 --concurrency 64 --max-tokens 128

The direct engine is created by this script; the platform's worker sits idle meanwhile.
"""

import argparse
import asyncio
import os
import statistics
import time
import uuid
from dataclasses import dataclass

from openai import AsyncOpenAI

from shared.schemas import Message, Sampling
from services.worker.engines.base import Engine, GenerationRequest
from services.worker.engines.sim import SimEngine
from services.worker.engines.transformers_engine import TransformersEngine, bundled_gguf_path

TOPICS = ["dragons", "the sea", "a robot", "a lighthouse", "winter", "a city", "bees", "the moon"]


@dataclass
class Result:
    ttft_s: float
    tokens: int
    duration_s: float
    gaps_s: list[float]


def prompt(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}."


async def direct_one(engine: Engine, i: int, max_tokens: int) -> Result:
    request = GenerationRequest(
        request_id=str(uuid.uuid4()),
        sampling=Sampling(max_tokens=max_tokens, temperature=0.7),
        messages=[Message(role="user", content=prompt(i))],
    )
    started = last = time.perf_counter()
    ttft = None
    tokens = 0
    gaps = []
    async for out in engine.generate(request):
        now = time.perf_counter()
        if out.text:
            if ttft is None:
                ttft = now - started
            else:
                gaps.append(now - last)
            last = now
        tokens = out.completion_tokens
    return Result(ttft or 0.0, tokens, time.perf_counter() - started, gaps)


async def stack_one(client: AsyncOpenAI, model: str, i: int, max_tokens: int) -> Result:
    started = last = time.perf_counter()
    ttft = None
    tokens = 0
    gaps = []
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt(i)}], max_tokens=max_tokens,
        temperature=0.7, stream=True, stream_options={"include_usage": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = now - started
            else:
                gaps.append(now - last)
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return Result(ttft or 0.0, tokens, time.perf_counter() - started, gaps)


async def level(run_one, concurrency: int, requests: int) -> dict:
    semaphore = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> Result:
        async with semaphore:
            return await run_one(i)

    started = time.perf_counter()
    results = await asyncio.gather(*(guarded(i) for i in range(requests)))
    wall = time.perf_counter() - started
    ttfts = sorted(r.ttft_s for r in results)
    gaps = sorted(g for r in results for g in r.gaps_s) or [0.0]
    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1000,
        "ttft_max_ms": ttfts[-1] * 1000,
        "itl_p50_ms": gaps[len(gaps) // 2] * 1000,
        "tokens": sum(r.tokens for r in results),
        "output_tok_s": sum(r.tokens for r in results) / wall,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("AXON_API_KEY", ""))
    parser.add_argument("--engine", choices=["transformers", "sim"], default="transformers")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name the platform serves")
    parser.add_argument("--sim-ttft-ms", type=float, default=50.0)
    parser.add_argument("--sim-itl-ms", type=float, default=20.0)
    args = parser.parse_args()

    engine: Engine
    if args.engine == "sim":
        engine = SimEngine(
            model_name=args.model, ttft_ms=args.sim_ttft_ms, itl_ms=args.sim_itl_ms,
            max_seqs=max(args.concurrency), context_tokens=32768,
        )
    else:
        engine = TransformersEngine(
            model_name=args.model, gguf_path=bundled_gguf_path(), max_seqs=max(args.concurrency),
            kv_cache_blocks=64, max_batch_tokens=512, threads=None,
        )
    await engine.start()
    rows = []
    await direct_one(engine, 0, 4)  # warm-up
    for c in args.concurrency:
        rows.append(("direct engine", c, await level(lambda i: direct_one(engine, i, args.max_tokens), c, c * args.rounds)))
    await engine.stop()

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600)
    await stack_one(client, args.model, 0, 4)  # warm-up
    for c in args.concurrency:
        run = lambda i: stack_one(client, args.model, i, args.max_tokens)  # noqa: E731
        rows.append(("full stack", c, await level(run, c, c * args.rounds)))

    print(f"\n{'path':<14} {'streams':>7} {'tokens':>7} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
          f"{'ITL p50 ms':>11} {'output tok/s':>13}")
    for name, c, r in rows:
        print(f"{name:<14} {c:>7} {r['tokens']:>7} {r['ttft_p50_ms']:>12.1f} {r['ttft_p99_ms']:>12.1f} "
              f"{r['itl_p50_ms']:>11.2f} {r['output_tok_s']:>13.1f}")
    by = {(n, c): r for n, c, r in rows}
    for c in args.concurrency:
        d, s = by[("direct engine", c)], by[("full stack", c)]
        print(f"streams={c}: stack/direct output tok/s = {s['output_tok_s'] / d['output_tok_s']:.3f}, "
              f"TTFT added p50 {s['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} ms, "
              f"p99 {s['ttft_p99_ms'] - d['ttft_p99_ms']:+.1f} ms, "
              f"ITL added p50 {s['itl_p50_ms'] - d['itl_p50_ms']:+.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
