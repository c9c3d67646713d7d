"""Anthropic's Messages API against chat completions on the same load (issue 39).

    .venv/bin/python benchmarks/messages.py            # 64 streams, 4 pairs, ~3 min

Starts its own worker (`sim`), session manager and gateway, with a database and Redis namespace of
their own (removed at the end). The same simulator load as `engine_vs_stack.py` and
`responses.py streaming` (64 streams kept in flight, 128-token answers, steady arrival), sent
alternately as chat completion streams (`/v1/chat/completions`) and as Messages streams
(`/v1/messages`, `stream`, with `x-api-key` as Anthropic's clients send the key), `--pairs` times
in one run, so both see the same machine. Both are timed by `axon bench`'s own client
(`send_one`, whose parser reads either stream: a Messages stream's text deltas are its content
events). Per pair and overall: TTFT p50/p99, output tokens/s and the CPU the gateway and the
session manager spent per request, and Messages against chat. Targets: TTFT p50 and throughput
within 2 % of chat's.
"""

import argparse
import asyncio
import sys

import orjson
from engine_vs_stack import prompt
from harness import BenchEnvironment
from responses import MODEL, Run, alternated_pairs, chat_one, sim_env

from services.cli.bench import request_headers, send_one
from shared.http1 import Http1Pool

# Within 2 % of chat's.
TOLERANCE = 0.02


async def messages_one(pool: Http1Pool, i: int, max_tokens: int) -> tuple[float | None, int, str | None]:
    body = orjson.dumps(
        {
            "model": MODEL,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt(i)}],
            "temperature": 0.7,
            "stream": True,
        }
    )
    result = await send_one(pool, body, stream=True, timeout_s=600)
    return result.ttft_s, result.output_tokens, result.error


async def streaming(args: argparse.Namespace, gateway_url: str, key: str, pids: dict[str, list[int]]) -> int:
    headers = request_headers(key)
    chat = Http1Pool(
        f"{gateway_url}/v1/chat/completions", headers=headers, max_idle_connections=args.streams, connect_timeout_s=10
    )
    anthropic_headers = {**{k: v for k, v in headers.items() if k != "Authorization"}, "x-api-key": key}
    anthropic_headers["anthropic-version"] = "2023-06-01"
    messages = Http1Pool(
        f"{gateway_url}/v1/messages", headers=anthropic_headers, max_idle_connections=args.streams, connect_timeout_s=10
    )
    modes = {
        "chat": lambda i: chat_one(chat, i, args.max_tokens),
        "messages": lambda i: messages_one(messages, i, args.max_tokens),
    }
    try:
        pairs = await alternated_pairs(modes, args, pids)
    finally:
        await chat.aclose()
        await messages.aclose()
    return report(args, pairs)


def _merged(pairs: list[dict[str, Run]], mode: str) -> Run:
    merged = Run()
    for runs in pairs:
        run = runs[mode]
        merged.ttfts_s += run.ttfts_s
        merged.tokens += run.tokens
        merged.errors += run.errors
        merged.wall_s += run.wall_s
        for process, seconds in run.cpu_s.items():
            merged.cpu_s[process] = merged.cpu_s.get(process, 0.0) + seconds
    return merged


def report(args: argparse.Namespace, pairs: list[dict[str, Run]]) -> int:
    print(
        f"\nsim engine (TTFT {args.sim_ttft_ms:g} ms, ITL {args.sim_itl_ms:g} ms), {args.streams} streams x "
        f"{args.rounds} requests of {args.max_tokens} tokens per mode and pair, modes alternated, {args.pairs} pairs"
    )
    print(
        f"{'pair':>4} {'mode':<9} {'requests':>8} {'errors':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
        f"{'output tok/s':>13} {'gateway CPU ms/req':>19} {'sessions CPU ms/req':>20}"
    )
    for number, runs in enumerate(pairs, 1):
        for mode, run in runs.items():
            print(
                f"{number:>4} {mode:<9} {run.requests:>8} {run.errors:>6} {run.ttft_ms(50):>12.1f} "
                f"{run.ttft_ms(99):>12.1f} {run.tok_s:>13.1f} {run.cpu_ms_per_request('gateway'):>19.2f} "
                f"{run.cpu_ms_per_request('sessions'):>20.2f}"
            )
    ttft_ratios = [runs["messages"].ttft_ms(50) / runs["chat"].ttft_ms(50) for runs in pairs]
    tok_ratios = [runs["messages"].tok_s / runs["chat"].tok_s for runs in pairs]
    chat, messages = _merged(pairs, "chat"), _merged(pairs, "messages")
    ttft_ratio = messages.ttft_ms(50) / chat.ttft_ms(50)
    tok_ratio = messages.tok_s / chat.tok_s
    print(f"TTFT p50 ratio per pair: {', '.join(f'{r:.3f}' for r in ttft_ratios)}")
    print(f"throughput ratio per pair: {', '.join(f'{r:.3f}' for r in tok_ratios)}")
    print(
        f"all pairs: TTFT p50 {messages.ttft_ms(50):.1f} / {chat.ttft_ms(50):.1f} ms, ratio {ttft_ratio:.3f} "
        f"(target <= {1 + TOLERANCE:.2f}: {'ok' if ttft_ratio <= 1 + TOLERANCE else 'MISSED'}); "
        f"throughput {messages.tok_s:.1f} / {chat.tok_s:.1f} tok/s, ratio {tok_ratio:.3f} "
        f"(target >= {1 - TOLERANCE:.2f}: {'ok' if tok_ratio >= 1 - TOLERANCE else 'MISSED'})"
    )
    print(
        "CPU per request, messages / chat: "
        + ", ".join(
            f"{process} {messages.cpu_ms_per_request(process):.2f} / {chat.cpu_ms_per_request(process):.2f} ms "
            f"({messages.cpu_ms_per_request(process) - chat.cpu_ms_per_request(process):+.2f})"
            for process in ("gateway", "sessions")
        )
    )
    return 0 if chat.errors == messages.errors == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream, per mode and pair")
    parser.add_argument("--pairs", type=int, default=4, help="chat and Messages rounds, alternated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sim-ttft-ms", type=float, default=50.0)
    parser.add_argument("--sim-itl-ms", type=float, default=20.0)
    args = parser.parse_args()
    worker = sim_env(streams=args.streams, ttft_ms=args.sim_ttft_ms, itl_ms=args.sim_itl_ms)
    with BenchEnvironment() as env:
        stack = env.start_stack(worker)
        key = env.create_key()
        print(f"platform ready (logs in {env.log_dir})", file=sys.stderr, flush=True)
        pids = {name: [stack[name].pid] for name in ("gateway", "sessions")}
        return asyncio.run(streaming(args, stack["gateway"].url, key, pids))


if __name__ == "__main__":
    sys.exit(main())
