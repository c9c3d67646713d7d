"""Time to first token and output tokens/s: the engine driven directly in this process,
then the same engine behind the whole platform (gateway -> session manager -> RabbitMQ ->
worker -> Redis -> back), at each concurrency level, in one run so the ratios compare.

Run against a platform started with `make up` (CPU engine, bundled SmolLM2):

    .venv/bin/python benchmarks/engine_vs_stack.py --concurrency 1 16

The direct engine is loaded by this script; the platform's worker sits idle meanwhile.
"""

import argparse
import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass

from openai import AsyncOpenAI

from shared.schemas import Message, Sampling
from services.worker.engines.base import GenerationRequest
from services.worker.engines.transformers_engine import TransformersEngine, bundled_gguf_path

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["dragons", "the sea", "a robot", "a lighthouse", "winter", "a city", "bees", "the moon"]


@dataclass
class Result:
    ttft_s: float
    tokens: int
    duration_s: float


def prompt(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}."


async def direct_one(engine: TransformersEngine, i: int, max_tokens: int) -> Result:
    request = GenerationRequest(
        request_id=str(uuid.uuid4()),
        sampling=Sampling(max_tokens=max_tokens, temperature=0.7),
        messages=[Message(role="user", content=prompt(i))],
    )
    started = time.perf_counter()
    ttft = None
    tokens = 0
    async for out in engine.generate(request):
        if ttft is None and out.text:
            ttft = time.perf_counter() - started
        tokens = out.completion_tokens
    return Result(ttft or 0.0, tokens, time.perf_counter() - started)


async def stack_one(client: AsyncOpenAI, i: int, max_tokens: int) -> Result:
    started = time.perf_counter()
    ttft = None
    tokens = 0
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt(i)}], max_tokens=max_tokens,
        temperature=0.7, stream=True, stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return Result(ttft or 0.0, tokens, time.perf_counter() - started)


async def level(run_one, concurrency: int, requests: int) -> dict:
    semaphore = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> Result:
        async with semaphore:
            return await run_one(i)

    started = time.perf_counter()
    results = await asyncio.gather(*(guarded(i) for i in range(requests)))
    wall = time.perf_counter() - started
    ttfts = sorted(r.ttft_s for r in results)
    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_max_ms": ttfts[-1] * 1000,
        "tokens": sum(r.tokens for r in results),
        "output_tok_s": sum(r.tokens for r in results) / wall,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = parser.parse_args()

    engine = TransformersEngine(
        model_name=MODEL, gguf_path=bundled_gguf_path(), max_seqs=max(args.concurrency),
        kv_cache_blocks=64, max_batch_tokens=512, threads=None,
    )
    await engine.start()
    rows = []
    await direct_one(engine, 0, 4)  # warm-up
    for c in args.concurrency:
        rows.append(("direct engine", c, await level(lambda i: direct_one(engine, i, args.max_tokens), c, c * args.rounds)))
    await engine.stop()

    client = AsyncOpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=600)
    await stack_one(client, 0, 4)  # warm-up
    for c in args.concurrency:
        rows.append(("full stack", c, await level(lambda i: stack_one(client, i, args.max_tokens), c, c * args.rounds)))

    print(f"\n{'path':<14} {'streams':>7} {'tokens':>7} {'TTFT p50 ms':>12} {'TTFT max ms':>12} {'output tok/s':>13}")
    for name, c, r in rows:
        print(f"{name:<14} {c:>7} {r['tokens']:>7} {r['ttft_p50_ms']:>12.1f} {r['ttft_max_ms']:>12.1f} {r['output_tok_s']:>13.1f}")
    by = {(n, c): r for n, c, r in rows}
    for c in args.concurrency:
        d, s = by[("direct engine", c)], by[("full stack", c)]
        print(f"streams={c}: stack/direct output tok/s = {s['output_tok_s'] / d['output_tok_s']:.3f}, "
              f"TTFT p50 added = {s['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
