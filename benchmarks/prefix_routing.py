"""Routing on the prefix index against today's rules, on vLLM (issue 38's workload).

    .venv/bin/python benchmarks/prefix_routing.py              # about 15 minutes on 2 cores
    .venv/bin/python benchmarks/prefix_routing.py --cost       # the session manager's cost only

Two workers on the vLLM engine, one core each (`AXON_CPU_THREADS_BIND` 0 and 1), each with a
small KV cache (`--kv-cache-gib`: about 11,600 of the bundled SmolLM2's tokens, 0.25 GiB in
bfloat16, 0.5 in float32, the worker's dtype on a CPU without bfloat16 arithmetic), and two
session managers with a gateway each: `index` (`AXON_PREFIX_ROUTING=true`, the default) and
`today` (`AXON_PREFIX_ROUTING=false`: session affinity only, so one-shot requests go to the
shared queue). `--phases` picks which run, in that order; each phase asks about documents of its
own, so neither finds the other's in the caches.

Per phase, three workloads:

- `sequential`: `--documents` documents of about 1,550 tokens each (words of English text), asked
  about by one-shot chat requests (the document, then a question of its own) in `--rounds`
  shuffled rounds, one request at a time;
- `concurrent`: the same with other documents, `--in-flight` requests at a time;
- `hot`: one more document asked about once, then `--hot` requests about it at once.

Printed per phase and workload: requests, errors, cached prompt tokens / prompt tokens after the
first round (vLLM's `cached_tokens`: whole blocks found in the worker's prefix cache), time to
first token p50 and p99 after the first round; for `hot`, the share of its requests each worker
served (from the workers' `axon_worker_jobs_total`). Then index / today.

`--cost` measures instead what routing costs the session manager per request: the prompt's
anchors and one pipelined SMISMEMBER per worker against the local Redis, CPU per decision.
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx
from harness import INTERNAL_TOKEN, BenchEnvironment, start_service_pair, start_vllm_workers_per_core

from services.sessions.prefix_routing import PrefixRouter
from services.worker.engines.vllm_config import cpu_dtype, cpu_flags
from shared.names import Names
from shared.prefix_index import PrefixIndex, anchors
from shared.redis_pipe import RedisPipe
from shared.registry import LiveModel
from shared.schemas import Job, Message

MODEL = "prefix-vllm"
VOCABULARY = (
    "the river town market bridge winter harvest council road school mill farmer teacher letter morning "
    "evening north south station garden library museum harbour ship storm record year people city village "
    "water field house church street window summer autumn spring family friend history story"
).split()
QUESTIONS = ("who is it about", "what happened in winter", "where is the market", "when did the storm come")


def document(tag: str, number: int, words: int) -> str:
    rng = random.Random(f"{tag}-{number}")
    return f"Document {tag}-{number}. " + " ".join(rng.choice(VOCABULARY) for _ in range(words))


def workers_jobs(workers: list[str]) -> dict[str, float]:
    """Each worker's jobs finished so far (`axon_worker_jobs_total`, every outcome)."""
    totals = {}
    for url in workers:
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {INTERNAL_TOKEN}"}, timeout=10).text
        totals[url] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("axon_worker_jobs_total{") and f'model="{MODEL}"' in line
        )
    return totals


async def ask(http: httpx.AsyncClient, text: str, question: str) -> dict:
    """One streamed one-shot request: time to first token, prompt and cached tokens (None on error)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{text}\n\nQuestion: {question}?"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    usage = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or [{}]
            # The first token: the first text, or the end of an answer that had none.
            if ttft is None and (choices[0].get("delta", {}).get("content") or choices[0].get("finish_reason")):
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None or ttft is None:
        return {"error": "no usage"}
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": ttft, "prompt": usage["prompt_tokens"], "cached": details.get("cached_tokens") or 0}


async def rounds(http: httpx.AsyncClient, documents: list[str], *, rounds: int, in_flight: int, seed: int) -> list:
    """`rounds` shuffled rounds of one question per document, `in_flight` at a time; the results per round."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(in_flight)
    results = []
    for round_ in range(rounds):
        order = list(range(len(documents)))
        rng.shuffle(order)

        async def one(i: int, round_: int = round_) -> dict:
            async with gate:
                return await ask(http, documents[i], QUESTIONS[round_ % len(QUESTIONS)] + f" ({round_})")

        results.append(await asyncio.gather(*(one(i) for i in order)))
    return results


def summary(later: list[dict]) -> dict:
    ok = [r for r in later if "error" not in r]
    ttfts = sorted(r["ttft"] for r in ok)
    return {
        "requests": len(later),
        "errors": len(later) - len(ok),
        "cached": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
        "p50": statistics.median(ttfts) if ttfts else float("nan"),
        "p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan"),
        "prompt": statistics.mean(r["prompt"] for r in ok) if ok else float("nan"),
    }


async def phase(gateway: str, key: str, workers: list[str], args: argparse.Namespace, tag: str) -> dict:
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(
        base_url=gateway, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=600
    ) as http:
        out = {}
        for name, in_flight in (("sequential", 1), ("concurrent", args.in_flight)):
            documents = [document(f"{tag}-{name}", n, args.words) for n in range(args.documents)]
            results = await rounds(http, documents, rounds=args.rounds, in_flight=in_flight, seed=len(tag))
            out[name] = summary([r for later in results[1:] for r in later])
        hot = document(f"{tag}-hot", 0, args.words)
        await ask(http, hot, "what is it about")
        before = workers_jobs(workers)
        answers = await asyncio.gather(*(ask(http, hot, f"question {i}") for i in range(args.hot)))
        after = workers_jobs(workers)
        out["hot"] = summary(list(answers))
        out["hot"]["shares"] = [round((after[w] - before[w]) / args.hot, 2) for w in workers]
        return out


def cost() -> int:
    """The session manager's CPU per routing decision (anchors + SMISMEMBER on two workers' sets)."""

    async def measure() -> None:
        pipe = RedisPipe("redis://127.0.0.1:6379/0", timeout_s=5)
        names = Names(f"prefix-cost-{random.randrange(1 << 30)}")
        text = document("cost", 0, 1150)
        question = Message(role="user", content=f"{text}\n\nQuestion: why?")
        job = Job(job_id="j", model=MODEL, channel="c", deadline=time.time() + 60, messages=[question])
        keys = [a.key for a in anchors(messages=job.messages, prompt=None)]
        await pipe.execute("SADD", names.prefix_index(MODEL, "w1"), *keys[:-1])
        index = PrefixIndex(pipe, names)
        live = LiveModel(2, 8192, homes=frozenset({"w1", "w2"}), indexed=frozenset({"w1", "w2"}))
        router = PrefixRouter(index, spill_seqs=2, lookup_timeout_s=1)
        n = 5000
        started = time.process_time()
        for _ in range(n):
            anchors(messages=job.messages, prompt=None)
        anchors_us = (time.process_time() - started) / n * 1e6
        for _ in range(200):
            await router.route(job, live, session_home=None)
        started, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            await router.route(job, live, session_home=None)
        route_us = (time.process_time() - started) / n * 1e6
        wall_us = (time.perf_counter() - wall) / n * 1e6
        await pipe.execute("DEL", names.prefix_index(MODEL, "w1"))
        await pipe.aclose()
        print(
            f"{len(text)}-character prompt, {len(keys)} anchors: anchors {anchors_us:.0f} us CPU; "
            f"routing decision (anchors + 2 SMISMEMBER + rule) {route_us:.0f} us CPU, {wall_us:.0f} us wall"
        )

    asyncio.run(measure())
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="index,today", help="which to run, in order: index, today")
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--words", type=int, default=1530, help="words per document (about a token each)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per workload, the first one warming the caches")
    parser.add_argument("--in-flight", type=int, default=8, help="requests at a time in the concurrent workload")
    parser.add_argument("--hot", type=int, default=16, help="requests at once about the hot document")
    parser.add_argument(
        "--kv-cache-gib", type=float, help="default: about 11,600 tokens (0.25 in bfloat16, 0.5 in float32)"
    )
    parser.add_argument("--cost", action="store_true", help="measure the session manager's cost per request only")
    args = parser.parse_args()
    if args.cost:
        return cost()
    if args.kv_cache_gib is None:
        args.kv_cache_gib = 0.5 if cpu_dtype("auto", cpu_flags()) == "float32" else 0.25
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    results = {}
    with BenchEnvironment() as env:
        env.models.add(MODEL)
        workers = [
            worker.url
            for worker in start_vllm_workers_per_core(
                env,
                MODEL,
                label="prefix",
                settings={"AXON_KV_CACHE_GIB": str(args.kv_cache_gib), "AXON_MAX_SEQS": "16"},
            )
        ]
        gateways = {
            name: start_service_pair(env, name, {"AXON_PREFIX_ROUTING": str(name == "index").lower()}).url
            for name in phases
        }
        key = env.create_key()
        print(f"stack ready (logs in {env.log_dir})", file=sys.stderr, flush=True)
        for name in phases:
            print(f"{name}...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            results[name] = asyncio.run(phase(gateways[name], key, workers, args, name))
            print(f"  {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(
        f"\n2 vLLM workers x 1 core (the bundled SmolLM2), KV cache {args.kv_cache_gib:g} GiB each; {args.documents} "
        f"documents of {args.words} words, {args.rounds} shuffled rounds of one-shot requests (figures after the first)"
    )
    print(
        f"{'phase':<7} {'workload':<11} {'requests':>8} {'errors':>6} {'prompt':>7} {'cached':>7} "
        f"{'TTFT p50':>9} {'p99':>8}  shares"
    )
    for name, workloads in results.items():
        for workload, r in workloads.items():
            shares = " / ".join(f"{s:.2f}" for s in r.get("shares", ()))
            print(
                f"{name:<7} {workload:<11} {r['requests']:>8} {r['errors']:>6} {r['prompt']:>7.0f} {r['cached']:>7.3f} "
                f"{r['p50'] * 1000:>7.0f}ms {r['p99'] * 1000:>6.0f}ms  {shares}"
            )
    if "index" in results and "today" in results:
        for workload in ("sequential", "concurrent", "hot"):
            new, old = results["index"][workload], results["today"][workload]
            print(
                f"index / today, {workload}: cached {new['cached']:.3f} vs {old['cached']:.3f}, "
                f"TTFT p50 {new['p50'] / old['p50']:.2f} x"
            )
    errors = sum(r["errors"] for workloads in results.values() for r in workloads.values())
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
