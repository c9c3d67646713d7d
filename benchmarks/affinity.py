"""Session affinity: what routing a session's turns to the worker holding its prefix cache buys.

    .venv/bin/python benchmarks/affinity.py                 # about 4 minutes on 2 cores

It starts three sim workers with the prefix-cache model (AXON_SIM_KV_BLOCKS, default 4096 blocks of
16 tokens each; AXON_SIM_PREFILL_US_PER_TOKEN, default 50 µs per uncached prompt token), and two
session managers with a gateway each: one with AXON_AFFINITY_WAIT_MS=250 (affinity on), one with
0 (off: every job to the model's shared queue), all in a database and Redis namespace of their own
(removed at the end). Then three phases, each its own 200 sessions x 8 turns over the public API
(`session_id`, so the session manager sends the growing history; streamed, usage included):

1. affinity on; 2. affinity off; 3. affinity on, one worker SIGKILLed halfway through.

A conversation: a system prompt (50 words), then per turn a user message of 100-300 words and an
answer of 100-300 tokens (`max_tokens`; the simulator emits exactly that many), so the eighth
turn's prompt is about 3,300 tokens. The simulator's tokens are words.

Arrivals are Poisson at 70 % of the capacity of the three workers without any cache hit, which is
derived, not measured: a worker runs AXON_SIM_MAX_SEQS sequences at once, each holding its slot
for AXON_SIM_TTFT_MS + AXON_SIM_PREFILL_US_PER_TOKEN x its prompt tokens + max_tokens x
AXON_SIM_ITL_MS, so capacity = 3 x max_seqs / the mean of that over the turns (computed from the
workload itself). Every phase offers the same load: the same conversation lengths and arrival
times (seed 0), in words of its own (no phase finds another's blocks cached). Each arrival is the
next turn of a session picked at random among `--active` sessions in progress that are not
waiting for an answer (a session enters when another finishes its eighth turn); if all are
waiting, the arrival waits for the first to be free (counted as `deferred`).

`--active` (48) sets how much history the workers' caches must hold: with affinity a worker holds
its third of the conversations in progress (16 x at most 210 blocks: they fit in 4,096), without
it every worker sees all 48 (about 5,300 blocks on average), so LRU evicts what the next turns
need, as a real engine's cache does when sized for its share of the traffic. With `--active 24`
everything fits everywhere and only the spread of turns over workers costs hits.

AXON_SIM_ITL_MS is 0 by default: the answer comes in a few chunks right after the first token, so
two CPU cores are not spent relaying tokens and time to first token measures queueing and
prefill, which is what affinity changes.

Printed per phase: turns, turns lost (an error or a stream cut), cached prompt tokens / prompt
tokens, time to first token and end-to-end p50 / p99 (ms, as the client sees them), throughput
(turns / s from the first arrival to the last answer); the on / off ratios; for the kill phase,
the killed worker's sessions' hit ratio on their first and second turns after the kill.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis.asyncio as aioredis
from harness import BenchEnvironment, start_gateways

from services.cli.launcher import Service
from shared.names import Names

MODEL = "affinity-sim"
WORKERS = 3
# A vocabulary for the conversations' words (the simulator's tokens are whitespace-separated words).
VOCABULARY = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ro", "si", "tu") for b in "aeiou" * 3]


@dataclass
class Turn:
    session: int
    index: int
    sent: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class Conversation:
    """One session's workload: its system prompt and, per turn, the user message and max_tokens."""

    system: str
    turns: list[tuple[str, int]]
    session_id: str = ""
    done: int = 0
    results: list[Turn] = field(default_factory=list)


def workload(phase: int, sessions: int, turns: int) -> list[Conversation]:
    """Every phase's conversations have the same lengths (seed 0); their words are the phase's own,
    so no phase finds another's blocks in the workers' caches."""
    lengths, words = random.Random(0), random.Random(phase)

    def text(count: int) -> str:
        return " ".join(words.choice(VOCABULARY) for _ in range(count))

    return [
        Conversation(
            system=f"phase {phase} session {i} " + text(46),
            turns=[(text(lengths.randint(100, 300)), lengths.randint(100, 300)) for _ in range(turns)],
        )
        for i in range(sessions)
    ]


def prompt_words(conversation: Conversation, turn: int) -> int:
    """The simulator's prompt tokens of a turn: `role: content` lines, split on whitespace."""
    words = 1 + len(conversation.system.split())
    for k, (message, answer) in enumerate(conversation.turns[: turn + 1]):
        words += 1 + len(message.split())
        if k < turn:
            words += 1 + answer
    return words


def capacity(
    conversations: list[Conversation], *, max_seqs: int, ttft_ms: float, itl_ms: float, prefill_us: float
) -> float:
    """Turns per second the workers sustain if no prompt token is ever cached (see the docstring)."""
    holds = [
        ttft_ms / 1000 + prefill_us / 1e6 * prompt_words(c, k) + itl_ms / 1000 * c.turns[k][1]
        for c in conversations
        for k in range(len(c.turns))
    ]
    return WORKERS * max_seqs / statistics.fmean(holds)


async def send_turn(http: httpx.AsyncClient, conversation: Conversation, turn: Turn, model: str = MODEL) -> None:
    message, max_tokens = conversation.turns[turn.index]
    body = {
        "model": model,
        "session_id": conversation.session_id,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    turn.sent = time.perf_counter()
    done = False
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    turn.error = str(event["error"].get("message", event["error"]))
                    return
                choices = event.get("choices") or []
                if turn.ttft_s is None and choices and choices[0].get("delta", {}).get("content"):
                    turn.ttft_s = time.perf_counter() - turn.sent
                usage = event.get("usage")
                if usage:
                    turn.prompt_tokens = usage["prompt_tokens"]
                    turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except (httpx.HTTPError, ValueError) as exc:
        turn.error = repr(exc)
        return
    turn.e2e_s = time.perf_counter() - turn.sent
    if not done:
        turn.error = "stream ended without [DONE]"


@dataclass
class Kill:
    """Kill `worker` once `at_turn` turns have been sent; remember whose home it was."""

    worker: Service
    worker_id: str
    at_turn: int
    redis_url: str
    names: Names
    killed_at: float = 0.0
    homed: set[int] = field(default_factory=set)

    async def fire(self, conversations: list[Conversation]) -> None:
        client = aioredis.from_url(self.redis_url)
        try:
            started = [i for i, c in enumerate(conversations) if c.session_id and c.done < len(c.turns)]
            homes = await client.mget([self.names.affinity(conversations[i].session_id) for i in started])
        finally:
            await client.aclose()
        self.homed = {
            i for i, home in zip(started, homes, strict=True) if home is not None and home.decode() == self.worker_id
        }
        self.worker.kill()
        self.killed_at = time.perf_counter()
        print(f"  killed {self.worker_id}: home of {len(self.homed)} sessions in progress", file=sys.stderr, flush=True)


async def run_phase(
    gateway_url: str,
    key: str,
    conversations: list[Conversation],
    *,
    sim_ttft: Callable[[Turn], float],
    rate: float,
    active: int,
    seed: int,
    kill: Kill | None = None,
    model: str = MODEL,
) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, limits=limits, timeout=120) as http:

        async def create(conversation: Conversation) -> None:
            response = await http.post("/v1/sessions", json={"title": "bench", "system_prompt": conversation.system})
            response.raise_for_status()
            conversation.session_id = str(response.json()["id"])

        for start in range(0, len(conversations), 50):
            await asyncio.gather(*(create(c) for c in conversations[start : start + 50]))

        waiting: deque[int] = deque(range(len(conversations)))
        idle: list[int] = [waiting.popleft() for _ in range(min(active, len(waiting)))]
        deferred = 0
        backlog = 0
        tasks: set[asyncio.Task[None]] = set()

        def launch(i: int) -> None:
            conversation = conversations[i]
            turn = Turn(session=i, index=conversation.done)
            conversation.results.append(turn)
            task = asyncio.create_task(run(conversation, i, turn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        def free(i: int) -> None:
            nonlocal backlog
            if conversations[i].done == len(conversations[i].turns):
                if not waiting:
                    return
                i = waiting.popleft()
            if backlog:
                backlog -= 1
                launch(i)
            else:
                idle.append(i)

        async def run(conversation: Conversation, i: int, turn: Turn) -> None:
            await send_turn(http, conversation, turn, model)
            conversation.done += 1
            free(i)

        total = sum(len(c.turns) for c in conversations)
        started = time.perf_counter()
        due = started
        for sent in range(total):
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if kill is not None and sent == kill.at_turn:
                await kill.fire(conversations)
            if idle:
                launch(idle.pop(rng.randrange(len(idle))))
            else:
                deferred += 1
                backlog += 1
        while tasks:
            await asyncio.gather(*list(tasks))
        elapsed = time.perf_counter() - started
    return summarize(conversations, elapsed=elapsed, deferred=deferred, kill=kill, sim_ttft=sim_ttft)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def hit_ratio(turns: list[Turn]) -> float:
    prompt = sum(t.prompt_tokens for t in turns if t.error is None)
    return sum(t.cached_tokens for t in turns if t.error is None) / prompt if prompt else float("nan")


def summarize(
    conversations: list[Conversation],
    *,
    elapsed: float,
    deferred: int,
    kill: Kill | None,
    sim_ttft: Callable[[Turn], float],
) -> dict:
    turns = [t for c in conversations for t in c.results]
    ok = [t for t in turns if t.error is None]
    ttft = [t.ttft_s * 1000 for t in ok if t.ttft_s is not None]
    engine = [sim_ttft(t) for t in ok]
    e2e = [t.e2e_s * 1000 for t in ok if t.e2e_s is not None]
    errors: dict[str, int] = {}
    for t in turns:
        if t.error is not None:
            errors[t.error] = errors.get(t.error, 0) + 1
    result = {
        "turns": len(turns),
        "lost": len(turns) - len(ok),
        "errors": errors,
        "deferred": deferred,
        "hit_ratio": hit_ratio(turns),
        "hit_ratio_after_first_turn": hit_ratio([t for t in turns if t.index > 0]),
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
        # What the simulator itself waited before the first token (its base plus the prefill of the
        # uncached tokens); the rest of the client's time to first token is queueing and the platform.
        "sim_ttft_ms": {"p50": percentile(engine, 0.5), "p99": percentile(engine, 0.99)},
        "e2e_ms": {"p50": percentile(e2e, 0.5), "p99": percentile(e2e, 0.99)},
        "throughput": len(ok) / elapsed,
        "elapsed_s": elapsed,
    }
    if kill is not None:
        after = [[t for t in conversations[i].results if t.sent > kill.killed_at] for i in sorted(kill.homed)]
        others = [
            t
            for i, c in enumerate(conversations)
            if i not in kill.homed
            for t in c.results
            if t.sent > kill.killed_at and t.index > 0
        ]
        first = [ts[0] for ts in after if ts]
        second = [ts[1] for ts in after if len(ts) > 1]
        result["kill"] = {
            "worker": kill.worker_id,
            "sessions": len(kill.homed),
            "next_turn_hit_ratio": hit_ratio(first),
            "next_turns": len(first),
            "second_turn_hit_ratio": hit_ratio(second),
            "second_turns": len(second),
            "next_turn_ttft_p50_ms": percentile([t.ttft_s * 1000 for t in first if t.ttft_s is not None], 0.5),
            "others_hit_ratio_after_kill": hit_ratio(others),
        }
    return result


def report(name: str, r: dict) -> None:
    ttft, e2e = r["ttft_ms"], r["e2e_ms"]
    print(
        f"{name:<14} {r['turns']:>6} {r['lost']:>5} {r['deferred']:>8} {r['hit_ratio']:>9.3f} "
        f"{r['hit_ratio_after_first_turn']:>10.3f} {ttft['p50']:>9.1f} {ttft['p99']:>9.1f} "
        f"{r['sim_ttft_ms']['p50']:>8.1f} {r['sim_ttft_ms']['p99']:>8.1f} "
        f"{e2e['p50']:>8.1f} {e2e['p99']:>8.1f} {r['throughput']:>9.2f}"
    )
    for message, count in list(r["errors"].items())[:5]:
        print(f"{'':>14} error x{count}: {message}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--active", type=int, default=48, help="sessions in progress at once")
    parser.add_argument("--load", type=float, default=0.7, help="offered load / capacity without cache hits")
    parser.add_argument("--max-seqs", type=int, default=1, help="AXON_SIM_MAX_SEQS of each worker")
    parser.add_argument("--ttft-ms", type=float, default=10.0, help="AXON_SIM_TTFT_MS")
    parser.add_argument("--itl-ms", type=float, default=0.0, help="AXON_SIM_ITL_MS")
    parser.add_argument("--prefill-us", type=float, default=50.0, help="AXON_SIM_PREFILL_US_PER_TOKEN")
    parser.add_argument("--kv-blocks", type=int, default=4096, help="AXON_SIM_KV_BLOCKS")
    parser.add_argument("--affinity-wait-ms", type=int, default=250, help="AXON_AFFINITY_WAIT_MS when on")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()

    worker_env = {
        "AXON_ENGINE": "sim",
        "AXON_MODEL": MODEL,
        "AXON_SIM_MAX_SEQS": str(args.max_seqs),
        "AXON_SIM_TTFT_MS": str(args.ttft_ms),
        "AXON_SIM_ITL_MS": str(args.itl_ms),
        "AXON_SIM_PREFILL_US_PER_TOKEN": str(args.prefill_us),
        "AXON_SIM_KV_BLOCKS": str(args.kv_blocks),
    }
    phases = {"affinity on": 1, "affinity off": 2, "on, 1 killed": 3}
    loads = {name: workload(seed, args.sessions, args.turns) for name, seed in phases.items()}
    rates = {
        name: args.load
        * capacity(c, max_seqs=args.max_seqs, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, prefill_us=args.prefill_us)
        for name, c in loads.items()
    }

    def sim_ttft(turn: Turn) -> float:
        return args.ttft_ms + args.prefill_us / 1000 * (turn.prompt_tokens - turn.cached_tokens)

    results: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "config": vars(args) | {"json": None}}
    with BenchEnvironment() as env:
        env.models.add(MODEL)
        workers = {
            f"bench-w{i}": env.start_service(
                "worker", name=f"worker-{i}", env={**worker_env, "AXON_WORKER_ID": f"bench-w{i}"}
            )
            for i in range(WORKERS)
        }
        gateways = start_gateways(env, args.affinity_wait_ms)
        key = env.create_key()
        print(f"stack ready (logs in {env.log_dir}); {os.cpu_count()} CPUs", file=sys.stderr, flush=True)
        print(
            f"{WORKERS} sim workers x {args.max_seqs} sequences, TTFT {args.ttft_ms:g} ms + {args.prefill_us:g} us per "
            f"uncached prompt token, ITL {args.itl_ms:g} ms, {args.kv_blocks} cache blocks each; "
            f"{args.sessions} sessions x {args.turns} turns per phase, {args.active} in progress at once"
        )
        total_turns = args.sessions * args.turns
        for name, seed in phases.items():
            rate = rates[name]
            print(
                f"{name}: {rate:.1f} turns/s ({args.load:.0%} of {rate / args.load:.1f})...",
                file=sys.stderr,
                flush=True,
            )
            kill = None
            if seed == 3:
                kill = Kill(workers["bench-w0"], "bench-w0", total_turns // 2, env.redis_url, Names(env.namespace))
            gateway = gateways["off" if name == "affinity off" else "on"]
            results[name] = asyncio.run(
                run_phase(
                    gateway.url, key, loads[name], sim_ttft=sim_ttft, rate=rate, active=args.active, seed=0, kill=kill
                )
            )
            results[name]["offered_rate"] = rate
    print(
        f"\n{'phase':<14} {'turns':>6} {'lost':>5} {'deferred':>8} {'hit ratio':>9} {'turns 2-8':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'sim p50':>8} {'sim p99':>8} {'E2E p50':>8} {'E2E p99':>8} {'turns/s':>9}"
    )
    for name in phases:
        report(name, results[name])
    on, off = results["affinity on"], results["affinity off"]
    ratios = {
        "ttft_p50": on["ttft_ms"]["p50"] / off["ttft_ms"]["p50"],
        "ttft_p99": on["ttft_ms"]["p99"] / off["ttft_ms"]["p99"],
        "throughput": on["throughput"] / off["throughput"],
    }
    results["ratios"] = ratios
    print(
        f"\naffinity on / off: hit ratio {on['hit_ratio']:.3f} / {off['hit_ratio']:.3f} (target >= 0.85 / about 1/3), "
        f"TTFT p50 x{ratios['ttft_p50']:.2f}, p99 x{ratios['ttft_p99']:.2f} (target <= 0.5), "
        f"throughput x{ratios['throughput']:.3f} (target within 3 %)"
    )
    killed = results["on, 1 killed"]
    k = killed["kill"]
    print(
        f"one worker killed: turns lost {killed['lost']} (target 0); its {k['sessions']} sessions in progress: "
        f"hit ratio {k['next_turn_hit_ratio']:.3f} on their next turn ({k['next_turns']} turns, TTFT p50 "
        f"{k['next_turn_ttft_p50_ms']:.1f} ms), {k['second_turn_hit_ratio']:.3f} on the one after "
        f"({k['second_turns']}); "
        f"other sessions after the kill {k['others_hit_ratio_after_kill']:.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
