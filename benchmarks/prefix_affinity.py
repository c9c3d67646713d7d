"""Would prefix-hash affinity pay for requests WITHOUT a session? (issue #17, item 1)

Three simulator engines with the prefix-cache model (`AXON_SIM_KV_BLOCKS` 4096 blocks each), in
process and with no latency: only the cache matters here. Sessionless chat requests are routed two
ways, and each way's prompt tokens served from cache are counted:

- `shared`: as today, any worker (the shared queue hands a job to whichever is free: uniform);
- `prefix`: a hash of the request's stable prefix (its system prompt, first user message and
  first answer, once it has one) picks the worker, as a session's home would.

Two workloads, both with one system prompt shared by all requests (as an application has):

- `one-shot`: independent questions (RAG, classification, extraction: most API traffic);
- `client-history`: conversations whose client resends the whole history every turn (an OpenAI
  client that does not use Axon's sessions);
- `few-shot`: one-shot questions after the same example exchange (a user message and its answer),
  which look like a conversation's later turn but all share that prefix.

Run: .venv/bin/python benchmarks/prefix_affinity.py
"""

import asyncio
import hashlib
import random
import time
from collections import Counter
from collections.abc import Callable

from services.worker.engines.base import GenerationRequest
from services.worker.engines.sim import SimEngine
from shared.schemas import Message, Sampling

WORKERS = 3
SYSTEM = " ".join(f"rule{i}" for i in range(150))
Route = Callable[[list[Message]], int]
_SPREAD = random.Random(7)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1_000_000)}" for _ in range(n))


def uniform(rng: random.Random) -> Route:
    return lambda _messages: rng.randrange(WORKERS)


def prefix_hash(messages: list[Message]) -> int:
    """Like `services/sessions/job_publishing.py:conversation_home`: a request with an answer in it goes to the
    worker its system prompt, first question and first answer hash to; any other to any worker."""
    if not any(m.role == "assistant" for m in messages):
        return _SPREAD.randrange(WORKERS)
    head = "\x00".join(m.content for m in messages[:3])
    return int.from_bytes(hashlib.blake2b(head.encode(), digest_size=8).digest()) % WORKERS


async def _ask(engine: SimEngine, messages: list[Message], answer_tokens: int) -> tuple[int, int, str]:
    request = GenerationRequest(
        request_id=str(random.random()), sampling=Sampling(max_tokens=answer_tokens), messages=messages
    )
    text, prompt, cached = "", 0, 0
    async for out in engine.generate(request):
        text += out.text
        prompt, cached = out.prompt_tokens, max(cached, out.cached_tokens)
    return prompt, cached, text


async def run(workload: str, route_name: str, seed: int = 1) -> tuple[float, Counter[int]]:
    rng = random.Random(seed)
    route = prefix_hash if route_name == "prefix" else uniform(random.Random(seed + 1))
    engines = [
        SimEngine(model_name="m", ttft_ms=0, itl_ms=0, max_seqs=64, context_tokens=32768, kv_blocks=4096)
        for _ in range(WORKERS)
    ]
    for engine in engines:
        await engine.start()
    prompt_total = cached_total = 0
    load: Counter[int] = Counter()
    example = [Message(role="user", content=_words(rng, 100)), Message(role="assistant", content=_words(rng, 100))]
    if workload in ("one-shot", "few-shot"):
        for _ in range(320):
            shots = example if workload == "few-shot" else []
            messages = [Message(role="system", content=SYSTEM), *shots, Message(role="user", content=_words(rng, 200))]
            worker = route(messages)
            prompt, cached, _ = await _ask(engines[worker], messages, 100)
            prompt_total, cached_total = prompt_total + prompt, cached_total + cached
            load[worker] += 1
    else:  # 40 conversations x 8 turns, interleaved (all of them fit in the three caches)
        conversations = [[Message(role="system", content=SYSTEM)] for _ in range(40)]
        for _turn in range(8):
            for history in rng.sample(conversations, len(conversations)):
                history.append(Message(role="user", content=_words(rng, rng.randrange(100, 300))))
                worker = route(history)
                prompt, cached, answer = await _ask(engines[worker], history, rng.randrange(100, 300))
                history.append(Message(role="assistant", content=answer))
                prompt_total, cached_total = prompt_total + prompt, cached_total + cached
                load[worker] += 1
    for engine in engines:
        await engine.stop()
    return cached_total / prompt_total, load


async def main() -> None:
    started = time.monotonic()
    for workload in ("one-shot", "client-history", "few-shot"):
        for route in ("shared", "prefix"):
            ratio, load = await run(workload, route)
            busiest = max(load.values()) / (sum(load.values()) / WORKERS)
            print(f"{workload:15} {route:7} cached/prompt {ratio:.3f}  busiest worker {busiest:.2f}x its share")
    print(f"({time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    asyncio.run(main())
