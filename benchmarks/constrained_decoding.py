"""Constrained decoding on the CPU engine: output tokens/s with and without a JSON schema, and the
cost of compiling a schema the first time and from the cache.

    .venv/bin/python benchmarks/constrained_decoding.py                 # 16 streams, 3 rounds, about 2 minutes

The engine comes from the worker's own factory with the worker's settings (the transformers engine
and the bundled SmolLM2 GGUF, `AXON_MAX_SEQS` = `--streams`). Each round sends `--streams` prompts at
once, greedy, `--max-tokens` each, twice: unconstrained, and with `response_format: json_schema`
(a schema whose answer is longer than `--max-tokens`, so both sides generate the same number of
tokens at the same batch sizes). The prompts are the same but for a tag naming the side and the
round, so neither side reuses the other's prefix cache; the side that goes first alternates, so
the machine's drift hits both; the figure is the median round of each side.

Compile: the schema (never seen before) is compiled once, which runs the probe process and then
the worker's compile, then again (the cache's hit). Target (issue 21): constrained >= 0.9 x
unconstrained output tokens/s.
"""

import argparse
import asyncio
import json
import os
import statistics
import time

from services.worker.engines.base import Engine, GenerationRequest, Guide
from services.worker.engines.factory import create_engine
from services.worker.settings import WorkerSettings
from shared.schemas import Message, Sampling

TOPICS = ["dragons", "the sea", "a robot", "a lighthouse", "winter", "a city", "bees", "the moon"]
STORY = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "characters": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "chapters": {"type": "array", "items": {"type": "string"}, "minItems": 40},
    },
    "required": ["title", "characters", "chapters"],
}


def messages(tag: str, i: int) -> list[Message]:
    # `tag` makes each round's prompts new to the engine: no side reuses the other's prefix cache.
    topic = TOPICS[i % len(TOPICS)]
    text = f"Write a long story about {topic} ({tag}) as JSON with a title, the characters and its chapters."
    return [Message(role="user", content=text)]


async def one(engine: Engine, tag: str, i: int, max_tokens: int, guide: Guide | None) -> int:
    request = GenerationRequest(
        request_id=f"{tag}-{i}",
        messages=messages(tag, i),
        sampling=Sampling(temperature=0, max_tokens=max_tokens),
        guide=guide,
    )
    tokens = 0
    async for out in engine.generate(request):
        tokens = out.completion_tokens
    return tokens


async def round_of(engine: Engine, tag: str, streams: int, max_tokens: int, guide: Guide | None) -> tuple[int, float]:
    started = time.perf_counter()
    counts = await asyncio.gather(*(one(engine, tag, i, max_tokens, guide) for i in range(streams)))
    return sum(counts), time.perf_counter() - started


async def main(args: argparse.Namespace) -> None:
    os.environ.update({"AXON_ENGINE": "transformers", "AXON_MAX_SEQS": str(args.streams)})
    engine = create_engine(WorkerSettings())
    load_before = os.getloadavg()
    await engine.start()
    try:
        grammars = engine._grammars  # type: ignore[attr-defined]  # the transformers engine's
        guide = Guide("json_schema", json.dumps(STORY))
        await grammars.compile(Guide("json_object"))  # another schema: the probe process is warm
        started = time.perf_counter()
        await grammars.compile(guide)
        first_ms = (time.perf_counter() - started) * 1000
        hits = grammars.hits
        started = time.perf_counter()
        await grammars.compile(guide)
        cached_ms = (time.perf_counter() - started) * 1000
        hit = grammars.hits == hits + 1

        await round_of(engine, "warm", 2, 4, None)  # the first forward passes are slower
        sides: dict[str, list[tuple[int, float]]] = {"unconstrained": [], "json_schema": []}
        for r in range(args.rounds):  # each side goes first every other round
            for name in sorted(sides, reverse=r % 2 == 1):
                side_guide = guide if name == "json_schema" else None
                sides[name].append(await round_of(engine, f"{name} {r}", args.streams, args.max_tokens, side_guide))
    finally:
        await engine.stop()
    load_after = os.getloadavg()

    print(
        f"transformers engine (bundled SmolLM2-135M GGUF), {args.streams} streams x {args.max_tokens} tokens, "
        f"greedy, {args.rounds} rounds; {os.cpu_count()} CPUs, load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after"
    )
    print(f"{'side':<14} {'tokens/round':>12} {'output tok/s per round':<32} {'median':>7}")
    medians = {}
    for name, rounds in sides.items():
        rates = [tokens / wall for tokens, wall in rounds]
        medians[name] = statistics.median(rates)
        tokens = "/".join(sorted({str(tokens) for tokens, _ in rounds}))
        print(f"{name:<14} {tokens:>12} {' '.join(f'{r:6.1f}' for r in rates):<32} {medians[name]:7.1f}")
    ratio = medians["json_schema"] / medians["unconstrained"]
    print(f"json_schema/unconstrained output tok/s = {ratio:.3f} (target >= 0.9: {'ok' if ratio >= 0.9 else 'MISSED'})")
    print(f"schema compile: first {first_ms:.1f} ms (probe + worker), again {cached_ms:.3f} ms (cache hit: {hit})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
